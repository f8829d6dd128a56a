/* Small horizontal bar charts in plain SVG, with a data table for screen readers and keyboard users. */
"use strict";

window.TMCharts = (function () {
  const SVG = "http://www.w3.org/2000/svg";
  let uid = 0;

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fmt(v, unit) {
    if (v === null || v === undefined || Number.isNaN(v)) return "n/a";
    const n = Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2);
    return unit ? `${n} ${unit}` : String(v);
  }

  /**
   * Render grouped horizontal bars.
   * spec: {title, desc, unit, series: [{name, cls}], rows: [{label, values: [number|null]}]}
   */
  function bars(container, spec) {
    container.replaceChildren();
    const id = `chart${++uid}`;
    const width = 370;
    const labelW = 92;
    const valueW = 56;
    const barH = 9;
    const gap = 2;
    const groupGap = 8;
    const n = spec.series.length;
    const groupH = n * barH + (n - 1) * gap;
    const height = Math.max(24, spec.rows.length * (groupH + groupGap) + groupGap);
    const max = Math.max(0, ...spec.rows.flatMap((r) => r.values.filter((v) => v !== null && v !== undefined)));
    const plotW = width - labelW - valueW;

    const svg = el("svg", {
      class: "bars", width, height, viewBox: `0 0 ${width} ${height}`,
      role: "img", "aria-labelledby": `${id}-t ${id}-d`,
    });
    svg.appendChild(el("title", { id: `${id}-t` }, spec.title));
    const summary = spec.rows
      .map((r) => `${r.label}: ` + r.values.map((v, i) => `${spec.series[i].name} ${fmt(v, spec.unit)}`).join(", "))
      .join("; ");
    svg.appendChild(el("desc", { id: `${id}-d` }, spec.rows.length ? `${spec.desc}. ${summary}` : `${spec.desc}: no data yet`));
    svg.appendChild(el("line", { class: "axis", x1: labelW, x2: labelW, y1: 0, y2: height }));

    spec.rows.forEach((row, ri) => {
      const y0 = groupGap / 2 + ri * (groupH + groupGap);
      svg.appendChild(el("text", { x: labelW - 6, y: y0 + groupH / 2 + 4, "text-anchor": "end" }, row.label));
      row.values.forEach((v, si) => {
        const y = y0 + si * (barH + gap);
        const w = max > 0 && v ? Math.max(1, (v / max) * plotW) : 0;
        const rect = el("rect", { class: spec.series[si].cls, x: labelW + 1, y, width: w, height: barH });
        rect.appendChild(el("title", {}, `${row.label} ${spec.series[si].name}: ${fmt(v, spec.unit)}`));
        svg.appendChild(rect);
        svg.appendChild(el("text", { x: labelW + 4 + w, y: y + barH - 1 }, fmt(v, spec.unit)));
      });
    });
    if (!spec.rows.length) {
      svg.appendChild(el("text", { x: labelW + 8, y: 16 }, "no data yet"));
    }
    container.appendChild(svg);

    if (n > 1) {
      const legend = document.createElement("p");
      legend.className = "legend";
      legend.setAttribute("aria-hidden", "true");
      for (const s of spec.series) {
        const item = document.createElement("span");
        const key = document.createElement("span");
        key.className = `key ${s.cls}`;
        item.append(key, s.name);
        legend.appendChild(item);
      }
      container.appendChild(legend);
    }

    // The same numbers as a table.
    const details = document.createElement("details");
    details.className = "data-table";
    const sum = document.createElement("summary");
    sum.textContent = `Data table: ${spec.title}`;
    const table = document.createElement("table");
    table.className = "data compact";
    const thead = table.createTHead().insertRow();
    for (const h of [spec.rowHeader || "", ...spec.series.map((s) => s.name)]) {
      const th = document.createElement("th");
      th.scope = "col";
      th.textContent = h;
      thead.appendChild(th);
    }
    const tbody = table.createTBody();
    for (const r of spec.rows) {
      const tr = tbody.insertRow();
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = r.label;
      tr.appendChild(th);
      for (const v of r.values) {
        const td = tr.insertCell();
        td.className = "num";
        td.textContent = fmt(v, spec.unit);
      }
    }
    details.append(sum, table);
    container.appendChild(details);
  }

  return { bars, fmt };
})();
