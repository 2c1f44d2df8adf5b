// Draws every <canvas data-chart="ID"> from the JSON in <script id="ID">, built on the server
// (planner/charts.py). Runs on load and after htmx swaps in new content.
(function () {
  function draw(root) {
    root.querySelectorAll("canvas[data-chart]").forEach(function (canvas) {
      if (canvas.dataset.drawn) return;
      var source = document.getElementById(canvas.dataset.chart);
      if (!source || typeof Chart === "undefined") return;
      canvas.dataset.drawn = "1";
      new Chart(canvas, JSON.parse(source.textContent));
    });
  }
  document.addEventListener("DOMContentLoaded", function () { draw(document); });
  document.addEventListener("htmx:afterSwap", function (event) { draw(event.target); });
})();
