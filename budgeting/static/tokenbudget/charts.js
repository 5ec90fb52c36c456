/* The admin's charts: each <canvas data-tb-chart="ID"> is drawn from the JSON spec in <script id="ID">
 * (budgeting.backoffice.reports.charts.Chart.spec) with the vendored Chart.js. Bars carry their values (no
 * hovering needed), stacked bars their totals; legends sit below; the canvas follows its box's width. */
(function () {
  "use strict";
  if (!window.Chart) { return; }
  Chart.register(window.ChartDataLabels);

  var css = getComputedStyle(document.documentElement);
  var ink = css.getPropertyValue("--body-fg").trim() || "#333";
  var quiet = css.getPropertyValue("--body-quiet-color").trim() || "#666";
  var grid = css.getPropertyValue("--hairline-color").trim() || "#ddd";
  var number = function (n) { return Number(n).toLocaleString("en-US"); };
  var timeFormats = { hour: "MMM d, HH:mm", day: "MMM d" };

  function stackTotal(chart, index) {
    return chart.data.datasets.reduce(function (sum, ds, i) {
      return chart.isDatasetVisible(i) ? sum + (ds.data[index].y !== undefined ? ds.data[index].y : ds.data[index]) : sum;
    }, 0);
  }

  function topOfStack(chart, datasetIndex, index) {
    for (var i = chart.data.datasets.length - 1; i >= 0; i--) {
      var raw = chart.data.datasets[i].data[index];
      var value = raw.y !== undefined ? raw.y : raw;
      if (chart.isDatasetVisible(i) && value > 0) { return i === datasetIndex; }
    }
    return false;
  }

  function value(ctx) {
    var raw = ctx.dataset.data[ctx.dataIndex];
    return raw.y !== undefined ? raw.y : raw;
  }

  function labels(stacked) {
    var inside = {
      color: "#fff",
      font: { size: 11, weight: "600" },
      formatter: function (v, ctx) { return number(value(ctx)); },
      display: function (ctx) {
        var bar = ctx.chart.getDatasetMeta(ctx.datasetIndex).data[ctx.dataIndex];
        return value(ctx) > 0 && bar && Math.abs(bar.base - bar.y) >= 16 && bar.width >= 18;
      }
    };
    var above = {
      anchor: "end",
      align: "end",
      offset: 2,
      color: ink,
      font: { size: 11, weight: "600" },
      formatter: function (v, ctx) { return number(stacked ? stackTotal(ctx.chart, ctx.dataIndex) : value(ctx)); },
      display: function (ctx) {
        return stacked ? topOfStack(ctx.chart, ctx.datasetIndex, ctx.dataIndex) : value(ctx) > 0;
      }
    };
    return stacked ? { labels: { value: inside, total: above } } : { labels: { value: above } };
  }

  function draw(canvas, spec) {
    var stacked = spec.series.length > 1;
    var time = spec.timeUnit;
    var datasets = spec.series.map(function (s) {
      return {
        label: s.label,
        backgroundColor: s.color,
        borderWidth: 0,
        maxBarThickness: 56,
        data: time ? s.values.map(function (v, i) { return { x: spec.labels[i], y: v }; }) : s.values,
        datalabels: labels(stacked)
      };
    });
    var x = {
      stacked: stacked,
      offset: true,
      grid: { display: false },
      title: { display: true, text: spec.xLabel, color: quiet },
      // Categories (a few buckets) all keep their label, turned if they must; a time axis picks its ticks.
      ticks: { color: ink, autoSkip: !!time, maxRotation: time ? 0 : 60, autoSkipPadding: 8 }
    };
    if (time) {
      x.type = "time";
      x.time = { unit: time, tooltipFormat: timeFormats[time], displayFormats: timeFormats };
      x.min = spec.labels[0];
      x.max = spec.labels[spec.labels.length - 1];
    }
    return new Chart(canvas, {
      type: "bar",
      data: { labels: time ? undefined : spec.labels, datasets: datasets },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        layout: { padding: { top: 18 } },
        scales: {
          x: x,
          y: {
            stacked: stacked,
            beginAtZero: true,
            grace: "8%",
            grid: { color: grid },
            title: { display: true, text: spec.yLabel, color: quiet },
            ticks: { color: ink, precision: 0, callback: number }
          }
        },
        plugins: {
          legend: { display: stacked, position: "bottom", labels: { color: ink, boxWidth: 12, boxHeight: 12 } },
          tooltip: {
            callbacks: { label: function (ctx) { return ctx.dataset.label + ": " + number(ctx.parsed.y); } }
          }
        }
      }
    });
  }

  document.querySelectorAll("canvas[data-tb-chart]").forEach(function (canvas) {
    var source = document.getElementById(canvas.dataset.tbChart);
    if (source) { draw(canvas, JSON.parse(source.textContent)); }
  });
})();
