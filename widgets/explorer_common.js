// Helpers both explorers' views share; the Python side puts this file in front of each view's
// module (one ES module per widget: anywidget loads each _esm on its own).

function el(tag, cls, text, parent) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

function fmtBytes(n) {
  for (const [unit, size] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (n >= size) return `${(n / size).toFixed(1)} ${unit}`;
  }
  return `${n} B`;
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "?";
  if (s < 1e-3) return `${Math.round(s * 1e6)} us`;
  if (s < 1) return `${(s * 1e3).toFixed(1)} ms`;
  return `${s.toFixed(2)} s`;
}
