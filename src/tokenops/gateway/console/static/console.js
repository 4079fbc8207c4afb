// Draws the usage page's charts with uPlot from the JSON the server rendered into #chart-data.
(function () {
  const el = document.getElementById("chart-data");
  if (!el || typeof uPlot === "undefined") return;
  const data = JSON.parse(el.textContent);
  if (!data.x.length) return;
  const bars = uPlot.paths.bars({ size: [0.8, 40] });
  const colours = ["#2563eb", "#16a34a", "#9333ea", "#ea580c", "#db2777"];
  const width = Math.min(660, Math.max(360, (document.querySelector("main").clientWidth - 60) / 2));
  const tokens = document.getElementById("tokens-chart");
  if (tokens) {
    new uPlot({
      width: width, height: 260,
      series: [{}].concat(data.token_types.map((t, i) => ({ label: t, stroke: colours[i % colours.length], width: 2,
        points: { show: false } }))),
      axes: [{}, { size: 60 }],
    }, [data.x].concat(data.token_types.map((t) => data.series[t])), tokens);
  }
  const cost = document.getElementById("cost-chart");
  if (cost) {
    new uPlot({
      width: width, height: 260,
      series: [{}, { label: "cost", stroke: "#b91c1c", fill: "rgba(185,28,28,.35)", width: 1, paths: bars,
        value: (u, v) => v == null ? "-" : v.toFixed(6), points: { show: false } }],
      axes: [{}, { size: 70, values: (u, vals) => vals.map((v) => v.toFixed(4)) }],
    }, [data.x, data.series.cost_micros.map((v) => v / 1e6)], cost);
  }
})();
