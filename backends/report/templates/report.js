"use strict";
// The rollout table: rows arrive as JSON and reach the page as text nodes only (never markup).
(function () {
  const data = JSON.parse(document.getElementById("rows-data").textContent);
  const col = {};
  data.fields.forEach(function (name, i) { col[name] = i; });
  const rows = data.rows;
  const PAGE = 100;
  const body = document.querySelector("#rollouts tbody");
  const search = document.getElementById("search");
  const status = document.getElementById("status");
  const phase = document.getElementById("phase");
  const count = document.getElementById("count");
  const prev = document.getElementById("prev");
  const next = document.getElementById("next");
  let shown = rows;
  let page = 0;
  let sortKey = null;
  let ascending = true;

  function cell(tr, text, cls) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = text;
    tr.appendChild(td);
    return td;
  }
  function link(td, text, href) {
    // Only the report's own relative links, which the generator percent-encoded.
    td.textContent = "";
    if (typeof href === "string" && href.startsWith("./report/")) {
      const a = document.createElement("a");
      a.setAttribute("href", href);
      a.textContent = text;
      td.appendChild(a);
    } else {
      td.textContent = text;
    }
  }
  function fmt(value, digits) {
    return value === null || value === undefined ? "–" : Number(value).toPrecision(digits).replace(/\.?0+$/, "");
  }
  function seconds(value) {
    if (!value) return "–";
    return value < 1 ? Math.round(value * 1000) + " ms" : value < 120 ? value.toFixed(1) + " s" : (value / 60).toFixed(1) + " min";
  }

  function render() {
    const pages = Math.max(1, Math.ceil(shown.length / PAGE));
    page = Math.min(page, pages - 1);
    const slice = shown.slice(page * PAGE, page * PAGE + PAGE);
    const fragment = document.createDocumentFragment();
    slice.forEach(function (r) {
      const tr = document.createElement("tr");
      tr.className = "rollout";
      link(cell(tr, ""), r[col.id], r[col.page]);
      cell(tr, r[col.what], "clip").title = r[col.what];
      const badge = document.createElement("span");
      badge.className = "badge " + (["success", "failure", "cancelled"].includes(r[col.status]) ? r[col.status] : "");
      badge.textContent = r[col.status] + (r[col.phase] ? " · " + r[col.phase] : "");
      cell(tr, "").appendChild(badge);
      cell(tr, fmt(r[col.reward], 3), "num");
      cell(tr, r[col.failure], "clip").title = r[col.failure];
      cell(tr, r[col.answer], "clip").title = r[col.answer];
      cell(tr, seconds(r[col.seconds]), "num");
      cell(tr, r[col.tokens] ? r[col.tokens].toLocaleString() : "–", "num");
      const arts = cell(tr, "", "num");
      if (r[col.artifacts]) link(arts, String(r[col.artifacts]), r[col.page] ? r[col.page] + "#artifacts" : null);
      else arts.textContent = "–";
      cell(tr, String(r[col.tries]), "num");
      fragment.appendChild(tr);
    });
    body.replaceChildren(fragment);
    const of = shown.length === rows.length ? " rollouts" : " (filtered from " + rows.length + ")";
    count.textContent = shown.length
      ? page * PAGE + 1 + "–" + (page * PAGE + slice.length) + " of " + shown.length + of
      : "no rollouts" + (rows.length ? " match" : " yet");
    prev.disabled = page === 0;
    next.disabled = page >= pages - 1;
  }

  function apply() {
    const needle = search.value.trim().toLowerCase();
    const wanted = status.value;
    const where = phase.value;
    shown = rows.filter(function (r) {
      if (wanted && r[col.status] !== wanted) return false;
      if (where && r[col.phase] !== where) return false;
      if (!needle) return true;
      return [r[col.id], r[col.what], r[col.answer], r[col.failure]].some(function (t) {
        return String(t).toLowerCase().includes(needle);
      });
    });
    if (sortKey !== null) {
      const i = col[sortKey];
      shown = shown.slice().sort(function (a, b) {
        const x = a[i], y = b[i];
        if (x === y) return 0;
        if (x === null) return 1;
        if (y === null) return -1;
        return (x < y ? -1 : 1) * (ascending ? 1 : -1);
      });
    }
    page = 0;
    render();
  }

  function sortBy(key, up) {
    sortKey = key;
    ascending = up;
    document.querySelectorAll("#rollouts th").forEach(function (h) {
      const on = h.getAttribute("data-key") === key;
      h.classList.toggle("sorted", on);
      h.classList.toggle("asc", on && up);
    });
  }
  // The view can be named in the address: #status=failure&phase=grading&q=timeout&sort=-reward
  function fromHash() {
    const wanted = new URLSearchParams(location.hash.slice(1));
    search.value = wanted.get("q") || "";
    status.value = wanted.get("status") || "";
    phase.value = wanted.get("phase") || "";
    const sort = wanted.get("sort") || "";
    const key = sort.replace(/^-/, "");
    if (Object.prototype.hasOwnProperty.call(col, key)) sortBy(key, !sort.startsWith("-"));
    apply();
  }

  document.querySelectorAll("#rollouts th[data-key]").forEach(function (th) {
    th.addEventListener("click", function () {
      const key = th.getAttribute("data-key");
      sortBy(key, sortKey === key ? !ascending : true);
      apply();
    });
  });
  search.addEventListener("input", apply);
  status.addEventListener("change", apply);
  phase.addEventListener("change", apply);
  prev.addEventListener("click", function () { page -= 1; render(); });
  next.addEventListener("click", function () { page += 1; render(); });
  window.addEventListener("hashchange", fromHash);
  fromHash();
  document.body.setAttribute("data-rendered", String(rows.length));
  document.body.setAttribute("data-render-ms", String(Math.round(performance.now())));
})();
