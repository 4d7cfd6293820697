// The django-awa admin dashboard: draws the rollup's series as SVG line charts
// and redraws them from the dashboard's JSON endpoint every few seconds.
// No library: a few functions over the DOM.
(function () {
  "use strict";

  var root = document.getElementById("awa-dashboard");
  var source = document.getElementById("awa-dashboard-data");
  if (!root || !source) {
    return;
  }
  var SVG = "http://www.w3.org/2000/svg";
  var WIDTH = 640;
  var HEIGHT = 180;
  var LEFT = 52;
  var RIGHT = 8;
  var TOP = 10;
  var BOTTOM = 22;
  var dataUrl = root.getAttribute("data-url");
  var windowName = root.getAttribute("data-window");
  var refresh = Math.max(1000, parseInt(root.getAttribute("data-refresh"), 10) || 5000);
  var scopeSelect = document.getElementById("awa-scope");
  var status = document.getElementById("awa-dashboard-status");
  var data = JSON.parse(source.textContent);
  var scope = "*";

  function node(name, attrs, parent) {
    var el = document.createElementNS(SVG, name);
    Object.keys(attrs).forEach(function (key) {
      el.setAttribute(key, attrs[key]);
    });
    if (parent) {
      parent.appendChild(el);
    }
    return el;
  }

  function count(n) {
    return Number(n).toLocaleString("en-US");
  }

  function seconds(s) {
    if (s === null || s === undefined) {
      return "-";
    }
    if (s < 1) {
      return (s * 1000).toFixed(0) + " ms";
    }
    if (s < 120) {
      return s.toFixed(1) + " s";
    }
    if (s < 7200) {
      return (s / 60).toFixed(1) + " min";
    }
    return (s / 3600).toFixed(1) + " h";
  }

  function clock(date) {
    return date.toISOString().slice(11, 16);
  }

  // The axis's top: the least of 1, 2, 3, 4, 5, 6 or 8 times a power of ten that is
  // not below the highest value, so the gridlines read as round figures.
  function roundTop(highest) {
    if (!(highest > 0)) {
      return 1;
    }
    var power = Math.pow(10, Math.floor(Math.log10(highest)));
    var steps = [1, 2, 3, 4, 5, 6, 8, 10];
    for (var i = 0; i < steps.length; i++) {
      if (steps[i] * power >= highest) {
        return steps[i] * power;
      }
    }
    return 10 * power;
  }

  // format: how the axis says a value (count, or seconds).
  function draw(svg, lines, format) {
    while (svg.firstChild) {
      svg.removeChild(svg.firstChild);
    }
    var top = 0;
    lines.forEach(function (line) {
      line.values.forEach(function (v) {
        if (v !== null && v > top) {
          top = v;
        }
      });
    });
    var scale = roundTop(top);
    var points = lines.length ? lines[0].values.length : 0;
    var plotW = WIDTH - LEFT - RIGHT;
    var plotH = HEIGHT - TOP - BOTTOM;
    [0, 0.5, 1].forEach(function (f) {
      var y = TOP + plotH - f * plotH;
      node("line", { x1: LEFT, x2: WIDTH - RIGHT, y1: y, y2: y, class: "awa-grid" }, svg);
      var label = node("text", { x: LEFT - 4, y: y + 3, "text-anchor": "end", class: "awa-axis-y" }, svg);
      label.textContent = f === 0 ? "0" : format(f * scale);
    });
    var start = new Date(data.start);
    var span = points * data.step_seconds * 1000;
    [0, 0.5, 1].forEach(function (f) {
      var x = LEFT + f * plotW;
      var anchor = f === 0 ? "start" : f === 1 ? "end" : "middle";
      var label = node("text", { x: x, y: HEIGHT - 6, "text-anchor": anchor }, svg);
      label.textContent = clock(new Date(start.getTime() + f * span)) + " UTC";
    });
    lines.forEach(function (line) {
      // One polyline per stretch without gaps (a null is a point without data).
      var stretch = [];
      var drawn = 0;
      function flush() {
        if (stretch.length === 1) {
          // A lone point (data in one minute only): a dot, as a line of one point shows nothing.
          var xy = stretch[0].split(",");
          var dot = node("circle", { cx: xy[0], cy: xy[1], r: 3, class: "awa-dot-" + line.name }, svg);
          dot.setAttribute("data-series", line.name);
        } else if (stretch.length) {
          var el = node("polyline", { points: stretch.join(" "), class: "awa-line-" + line.name }, svg);
          el.setAttribute("data-series", line.name);
        }
        drawn += stretch.length;
        stretch = [];
      }
      line.values.forEach(function (v, i) {
        if (v === null) {
          flush();
          return;
        }
        var x = LEFT + (points > 1 ? (i / (points - 1)) * plotW : plotW / 2);
        var y = TOP + plotH - (v / scale) * plotH;
        stretch.push(x.toFixed(1) + "," + y.toFixed(1));
      });
      flush();
      svg.setAttribute("data-" + line.name + "-points", String(drawn));
    });
  }

  function fillScopes() {
    var have = {};
    Array.prototype.forEach.call(scopeSelect.options, function (option) {
      have[option.value] = true;
    });
    data.queues.forEach(function (queue) {
      if (!have[queue]) {
        var option = document.createElement("option");
        option.value = queue;
        option.textContent = queue;
        scopeSelect.appendChild(option);
      }
    });
  }

  function cell(row, text, className) {
    var td = document.createElement("td");
    td.textContent = text;
    if (className) {
      td.className = className;
    }
    row.appendChild(td);
    return td;
  }

  function fillTable() {
    var body = document.querySelector("#awa-dashboard-queues tbody");
    while (body.firstChild) {
      body.removeChild(body.firstChild);
    }
    var oldest = data.current.oldest_due;
    var names = data.queues.slice();
    Object.keys(oldest).forEach(function (q) {
      if (names.indexOf(q) < 0) {
        names.push(q);
      }
    });
    names.sort();
    names.forEach(function (queue) {
      var row = document.createElement("tr");
      row.setAttribute("data-queue", queue);
      var th = document.createElement("th");
      th.scope = "row";
      th.textContent = queue;
      row.appendChild(th);
      var totals = (data.series[queue] || { totals: { completed: 0, failed: 0, retried: 0 } }).totals;
      cell(row, count(totals.completed), "num completed");
      cell(row, count(totals.failed), "num failed");
      cell(row, count(totals.retried), "num retried");
      cell(row, seconds(oldest[queue] === undefined ? null : oldest[queue]), "num oldest");
      cell(row, data.current.paused.indexOf(queue) >= 0 ? "paused" : "", "status");
      body.appendChild(row);
    });
  }

  function render() {
    fillScopes();
    var series = data.series[scope] || data.series["*"];
    draw(document.getElementById("awa-chart-outcomes"), [
      { name: "completed", values: series.completed },
      { name: "failed", values: series.failed },
      { name: "retried", values: series.retried },
    ], count);
    draw(document.getElementById("awa-chart-wait"), [
      { name: "p50", values: series.wait_p50 },
      { name: "p95", values: series.wait_p95 },
    ], seconds);
    draw(document.getElementById("awa-chart-oldest"), [{ name: "oldest", values: series.oldest_due }], seconds);
    document.getElementById("awa-total-completed").textContent = count(series.totals.completed);
    document.getElementById("awa-total-failed").textContent = count(series.totals.failed);
    document.getElementById("awa-total-retried").textContent = count(series.totals.retried);
    var oldestNow =
      scope === "*" ? data.current.oldest_due_overall : data.current.oldest_due[scope];
    document.getElementById("awa-oldest-now").textContent = seconds(
      oldestNow === undefined ? null : oldestNow
    );
    fillTable();
    status.textContent =
      "as of " + data.now.slice(11, 19) + " UTC (" + data.generated_in_ms + " ms on the server)";
    root.setAttribute("data-updated", data.now);
  }

  // Set when asking again cannot help: the session ended or the permission went.
  var stopped = null;

  function poll() {
    fetch(dataUrl + "?window=" + encodeURIComponent(windowName), {
      credentials: "same-origin",
      headers: { Accept: "application/json" },
    })
      .then(function (response) {
        // Signed out (or the session expired), the admin answers with a redirect
        // to its login page, which fetch follows: an HTML page, not the data.
        // The endpoint itself never redirects.
        if (response.redirected) {
          stopped = "signed out: sign in again and reload this page to refresh";
          return null;
        }
        if (response.status === 403) {
          stopped = "no longer allowed to view jobs: the figures shown are not refreshed";
          return null;
        }
        if (!response.ok) {
          throw new Error("HTTP " + response.status);
        }
        return response.json();
      })
      .then(function (fresh) {
        if (fresh !== null) {
          data = fresh;
          render();
        }
      })
      .catch(function (error) {
        status.textContent = "could not refresh (" + error.message + "); trying again";
      })
      .then(function () {
        if (stopped === null) {
          window.setTimeout(poll, refresh);
        } else {
          status.textContent = stopped;
        }
      });
  }

  scopeSelect.addEventListener("change", function () {
    scope = scopeSelect.value;
    render();
  });
  render();
  window.setTimeout(poll, refresh);
})();
