// On a phone, the admin's lists (changelists and tabular inlines) show each row as a card of "label value"
// lines (admin.css, .tb-cards-list): every cell gets its column's header as data-label, which the CSS shows.
(function () {
  function label(table) {
    var heads = table.querySelectorAll("thead tr:first-child th");
    if (!heads.length) return;
    var names = Array.prototype.map.call(heads, function (th) { return th.textContent.trim(); });
    table.querySelectorAll("tbody tr").forEach(function (row) {
      Array.prototype.forEach.call(row.children, function (cell, i) {
        if (names[i] && !cell.hasAttribute("data-label")) cell.setAttribute("data-label", names[i]);
      });
    });
    table.classList.add("tb-cards-list");
  }
  function start() {
    document.querySelectorAll("#result_list, .inline-group .tabular table").forEach(label);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
