"""The web console under `/console`: server-rendered pages over the ops façade and the cluster
(app.py), its login session (session.py) and the one module that reads what the pages show (data.py).
Templates and the vendored chart library ship in templates/ and static/."""
