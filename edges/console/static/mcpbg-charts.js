/* mcpbg charts: spend over time per tenant with caps, refusals by reason (Chart.js). */
(function () {
  "use strict";
  var PALETTE = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#0891b2", "#db2777", "#65a30d", "#475569"];

  function dollars(micros) {
    var v = micros / 1e6;
    return "$" + (v >= 100 ? v.toFixed(0) : v.toFixed(2));
  }

  function clock(t, t0, relative, seconds) {
    if (relative) {
      var s = Math.max(0, Math.round(t - t0));
      var h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
      var text = "+" + (h ? h + "h" + String(m).padStart(2, "0") : m) + "m";
      return seconds && sec ? text + String(sec).padStart(2, "0") + "s" : text;
    }
    return new Date(t * 1000).toISOString().slice(11, seconds ? 19 : 16) + "Z";
  }

  /* A round tick step (seconds) giving about six ticks over span. */
  function niceStep(span) {
    var steps = [1, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
    for (var i = 0; i < steps.length; i++) if (span / steps[i] <= 7) return steps[i];
    return Math.ceil(span / 6 / 86400) * 86400;
  }

  /* Each bar's value at its end. */
  var barValues = {
    id: "mcpbgValues",
    afterDatasetsDraw: function (chart) {
      var ctx = chart.ctx, meta = chart.getDatasetMeta(0), data = chart.data.datasets[0].data;
      ctx.save(); ctx.fillStyle = "#334155"; ctx.font = "600 12px system-ui, sans-serif";
      ctx.textBaseline = "middle";
      meta.data.forEach(function (bar, i) {
        ctx.fillText(Number(data[i]).toLocaleString("en-US"), bar.x + 6, bar.y);
      });
      ctx.restore();
    }
  };

  /* A vertical line where the breaker tripped. */
  var tripLine = {
    id: "mcpbgTrip",
    afterDatasetsDraw: function (chart, args, opts) {
      if (opts.at == null) return;
      var x = chart.scales.x.getPixelForValue(opts.at), area = chart.chartArea, ctx = chart.ctx;
      if (x < area.left || x > area.right) return;
      ctx.save();
      ctx.strokeStyle = "#dc2626"; ctx.lineWidth = 2; ctx.setLineDash([6, 4]);
      ctx.beginPath(); ctx.moveTo(x, area.top); ctx.lineTo(x, area.bottom); ctx.stroke();
      ctx.setLineDash([]); ctx.fillStyle = "#dc2626"; ctx.font = "600 12px system-ui, sans-serif";
      ctx.textAlign = x > area.right - 140 ? "right" : "left";
      ctx.fillText(opts.label || "breaker tripped", x + (ctx.textAlign === "left" ? 6 : -6), area.top + 14);
      ctx.restore();
    }
  };

  /* series: {t: [...], tenants: {name: [micros...]}}; caps: [{tenant, value, label}];
     trip: epoch seconds or null; relative: label the x axis from the first point. */
  window.mcpbgSpendChart = function (canvas, series, caps, trip, relative, old) {
    var t = series.t || [], t0 = t.length ? t[0] : 0, names = Object.keys(series.tenants || {});
    var datasets = [];
    names.forEach(function (name, i) {
      var color = PALETTE[i % PALETTE.length];
      datasets.push({
        label: name, data: t.map(function (x, j) { return {x: x, y: series.tenants[name][j]}; }),
        borderColor: color, backgroundColor: color + "22", fill: true, tension: 0.15,
        pointRadius: 0, borderWidth: 2
      });
      (caps || []).forEach(function (cap) {
        if (cap.tenant !== name || !t.length) return;
        datasets.push({
          label: name + " cap " + dollars(cap.value), data: [{x: t[0], y: cap.value}, {x: t[t.length - 1], y: cap.value}],
          borderColor: color, borderDash: [6, 4], borderWidth: 1.5, pointRadius: 0, fill: false
        });
      });
    });
    var globals = (caps || []).filter(function (cap) { return cap.tenant == null; });
    if (globals.length && names.length > 1) {
      datasets.push({
        label: "all tenants", borderColor: "#334155", borderWidth: 1.5, pointRadius: 0, fill: false,
        data: t.map(function (x, j) {
          return {x: x, y: names.reduce(function (sum, n) { return sum + series.tenants[n][j]; }, 0)};
        })
      });
    }
    globals.forEach(function (cap) {
      if (!t.length) return;
      datasets.push({
        label: cap.label + " " + dollars(cap.value), data: [{x: t[0], y: cap.value}, {x: t[t.length - 1], y: cap.value}],
        borderColor: "#dc2626", borderDash: [2, 3], borderWidth: 1.5, pointRadius: 0, fill: false
      });
    });
    var span = t.length ? t[t.length - 1] - t0 : 0, step = niceStep(Math.max(span, 1));
    var xmin = t.length ? t0 : undefined, xmax = t.length ? t[t.length - 1] : undefined;
    var tick = function (v) { return clock(v, t0, relative, step < 60); };
    /* Ticks every step from the first point (relative) or on round clock times. */
    var ticksFrom = function (axis) {
      if (!t.length) return;
      var start = relative ? t0 : Math.ceil(t0 / step) * step, out = [];
      for (var v = start; v <= xmax + 1e-6 && out.length < 60; v += step) out.push({value: v});
      axis.ticks = out;
    };
    if (old) {
      old.data.datasets = datasets; old.options.plugins.mcpbgTrip.at = trip;
      Object.assign(old.options.scales.x, {min: xmin, max: xmax, afterBuildTicks: ticksFrom});
      Object.assign(old.options.scales.x.ticks, {stepSize: step, callback: tick});
      old.update("none"); return old;
    }
    return new Chart(canvas, {
      type: "line", data: {datasets: datasets}, plugins: [tripLine],
      options: {
        animation: false, responsive: true, maintainAspectRatio: false, parsing: false,
        interaction: {mode: "nearest", axis: "x", intersect: false},
        scales: {
          x: {type: "linear", min: xmin, max: xmax, afterBuildTicks: ticksFrom, ticks: {callback: tick, stepSize: step, maxTicksLimit: 9},
              grid: {color: "#eef0f3"},
              title: {display: true, text: relative ? "simulated time from the first event" : "time (UTC)"}},
          y: {beginAtZero: true, ticks: {callback: function (v) { return dollars(v); }}, grid: {color: "#eef0f3"},
              title: {display: true, text: "spent (cumulative)"}}
        },
        plugins: {
          mcpbgTrip: {at: trip},
          legend: {position: "bottom", labels: {boxWidth: 14, usePointStyle: false}},
          tooltip: {callbacks: {
            title: function (items) { return items.length ? clock(items[0].parsed.x, t0, relative, true) : ""; },
            label: function (item) { return item.dataset.label + ": " + dollars(item.parsed.y); }
          }}
        }
      }
    });
  };

  /* rows: [{reason, refusals}] */
  window.mcpbgReasonChart = function (canvas, rows, old) {
    var labels = rows.map(function (r) { return r.reason; });
    var data = rows.map(function (r) { return r.refusals; });
    var colors = rows.map(function (r) {
      return r.status === 503 ? "#dc2626" : r.status === 402 ? "#d97706" : "#6366f1";
    });
    if (old) { old.data.labels = labels; old.data.datasets[0].data = data; old.data.datasets[0].backgroundColor = colors; old.update("none"); return old; }
    return new Chart(canvas, {
      type: "bar",
      data: {labels: labels, datasets: [{label: "refused calls", data: data, backgroundColor: colors, borderRadius: 4,
                                         minBarLength: 4, maxBarThickness: 28}]},
      plugins: [barValues],
      options: {
        layout: {padding: {right: 48}},
        indexAxis: "y", animation: false, responsive: true, maintainAspectRatio: false,
        plugins: {legend: {display: false}},
        scales: {x: {beginAtZero: true, ticks: {precision: 0}, grid: {color: "#eef0f3"}}, y: {grid: {display: false}}}
      }
    });
  };
})();
