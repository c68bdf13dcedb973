// PlacementExplorer's view (anywidget ESM, after explorer_common.js). Everything drawn comes
// from the model's traitlets: layouts (who holds which block), steps (kind, groups, bytes,
// predicted time, the layouts around each step) and frames (per step, the transfers: src rank,
// dst rank, region, reduces). Python never sends SVG; a picker or step change sets a traitlet.

const SVGNS = "http://www.w3.org/2000/svg";
const TILE_W = 104, TILE_H = 84, GAP = 10, PAD = 6, LABEL_H = 14, MAX_RECTS = 256;
const FLY_MS = 900;

function svg(tag, attrs, parent) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

function prod(xs) { return xs.reduce((a, b) => a * b, 1); }

function regionText(offset, shape) {
  if (!offset.length) return "the scalar";
  return "[" + offset.map((o, i) => `${o}:${o + shape[i]}`).join(", ") + "]";
}

// the tensor seen as rows x cols: leading dims stacked into rows
function grid2(shape) {
  if (shape.length === 0) return [1, 1];
  if (shape.length === 1) return [1, shape[0]];
  return [prod(shape.slice(0, -1)), shape[shape.length - 1]];
}

// a block (offset, shape) as rectangles of that rows x cols view
function blockRects(shape, offset, bshape) {
  const n = shape.length;
  if (n === 0) return [{ r: 0, c: 0, h: 1, w: 1 }];
  if (bshape.some((s) => s === 0)) return [];
  if (n === 1) return [{ r: 0, c: offset[0], h: 1, w: bshape[0] }];
  const lead = shape.slice(0, n - 2), rowsPer = shape[n - 2];
  const combos = [[]];
  for (let d = 0; d < lead.length; d++) {
    const next = [];
    for (const c of combos) for (let i = 0; i < bshape[d]; i++) next.push([...c, offset[d] + i]);
    combos.splice(0, combos.length, ...next);
    if (combos.length > MAX_RECTS) break;
  }
  return combos.slice(0, MAX_RECTS).map((idx) => {
    let flat = 0;
    for (let d = 0; d < lead.length; d++) flat = flat * lead[d] + (idx[d] || 0);
    return { r: flat * rowsPer + offset[n - 2], c: offset[n - 1], h: bshape[n - 2], w: bshape[n - 1] };
  });
}

// where each rank's tile sits: the mesh's last dim across, the others stacked down
function tilePlaces(meshShape, ranks, coordOf) {
  const cols = meshShape.length === 1 ? Math.min(meshShape[0], 8) : meshShape[meshShape.length - 1];
  const places = {};
  for (const r of ranks) {
    const coord = coordOf[r];
    let flat = 0;
    for (let d = 0; d < coord.length; d++) flat = flat * meshShape[d] + coord[d];
    places[r] = { row: Math.floor(flat / cols), col: flat % cols };
  }
  return places;
}

// draws one rank grid of mini tensors; returns where each rank's tensor is, to fly blocks
function drawTiles(parent, model, layout, x0, y0, groupOf) {
  const shape = model.get("shape"), colors = model.get("colors"), ranks = model.get("ranks");
  const [rows, cols] = grid2(shape);
  const cell = Math.max(1, Math.min(22, (TILE_W - 8) / Math.max(cols, 1), (TILE_H - LABEL_H - 8) / Math.max(rows, 1)));
  const coordOf = Object.fromEntries(layout.map((b) => [b.rank, b.coord]));
  const places = tilePlaces(model.get("mesh_shape"), ranks, coordOf);
  const geo = {};
  for (const b of layout) {
    const p = places[b.rank], color = colors[ranks.indexOf(b.rank) % colors.length];
    const tx = x0 + p.col * (TILE_W + GAP), ty = y0 + p.row * (TILE_H + GAP);
    const g = svg("g", { class: "dx-tile", "data-rank": b.rank }, parent);
    const group = groupOf ? groupOf[b.rank] : undefined;
    svg("rect", { x: tx, y: ty, width: TILE_W, height: TILE_H, rx: 6, class: "dx-tile-frame",
      stroke: group !== undefined ? colors[(group + 10) % colors.length] : "#bbb",
      "stroke-width": group !== undefined ? 3 : 1 }, g);
    const label = svg("text", { x: tx + 6, y: ty + 12, class: "dx-tile-label" }, g);
    label.textContent = `rank ${b.rank}` + (group !== undefined ? ` · g${group}` : "") +
      (b.partial ? " · partial" : "");
    const ox = tx + 4, oy = ty + LABEL_H + 4;
    svg("rect", { x: ox, y: oy, width: cols * cell, height: rows * cell, class: "dx-tensor" }, g);
    for (const q of blockRects(shape, b.offset, b.shape)) {
      const r = svg("rect", { x: ox + q.c * cell, y: oy + q.r * cell, width: q.w * cell, height: q.h * cell,
        fill: color, class: b.partial ? "dx-block dx-partial" : "dx-block" }, g);
      svg("title", {}, r).textContent = `rank ${b.rank} holds ${regionText(b.offset, b.shape)}` +
        (b.partial ? " (a partial value)" : "");
    }
    if (blockRects(shape, b.offset, b.shape).length === 0) {
      const t = svg("text", { x: ox + 2, y: oy + 12, class: "dx-empty" }, g);
      t.textContent = "empty";
    }
    geo[b.rank] = { ox, oy, cell };
  }
  const nrows = Math.max(...Object.values(places).map((p) => p.row)) + 1;
  const ncols = Math.max(...Object.values(places).map((p) => p.col)) + 1;
  return { geo, width: ncols * (TILE_W + GAP) - GAP, height: nrows * (TILE_H + GAP) - GAP };
}

function tilesSvg(model, layout, groupOf) {
  const root = svg("svg", { class: "dx-svg" });
  const { geo, width, height } = drawTiles(root, model, layout, PAD, PAD, groupOf);
  root.setAttribute("width", width + 2 * PAD);
  root.setAttribute("height", height + 2 * PAD);
  return { root, geo };
}

function pickerRow(model, side, title, parent) {
  const row = el("div", "dx-pickers", null, parent);
  el("span", "dx-side", title, row);
  const names = model.get("dim_names"), values = model.get(side);
  names.forEach((name, d) => {
    const lab = el("label", "dx-pick-label", `${name} `, row);
    const sel = el("select", "dx-pick", null, lab);
    sel.dataset.side = side;
    sel.dataset.dim = d;
    for (const c of model.get("choices")) el("option", null, c, sel).value = c;
    if (!model.get("choices").includes(values[d])) el("option", null, values[d], sel).value = values[d];
    sel.value = values[d];
    sel.addEventListener("change", () => {
      const next = [...model.get(side)];
      next[d] = sel.value;
      model.set(side, next);
      model.save_changes();
    });
  });
}

function layoutPanel(model, which, title, parent) {
  const panel = el("div", "dx-panel", null, parent);
  el("div", "dx-panel-title", `${title} [${model.get(which).join(", ")}]`, panel);
  const layout = (model.get("layouts") || {})[which] || [];
  if (layout.length) panel.appendChild(tilesSvg(model, layout).root);
  return panel;
}

function stepText(s, i) {
  const where = s.mesh_dim < 0 ? "to the other mesh" : `on ${s.mesh_dim_name || "dim " + s.mesh_dim}`;
  const groups = s.groups.map((g) => "(" + g.join(", ") + ")").join(" ");
  if (!s.collective) return `${i + 1}. ${s.kind} ${where} (${s.src} → ${s.dst}): local, no data moves`;
  return `${i + 1}. ${s.kind} ${where} (${s.src} → ${s.dst}): groups ${groups} · ` +
    `${fmtBytes(s.bytes_per_rank)}/rank${s.padded ? " (padded)" : ""} · predicted ${fmtSeconds(s.predicted_s)}`;
}

function planList(model, parent) {
  const box = el("div", "dx-plan", null, parent);
  const steps = model.get("steps");
  if (!steps.length && !model.get("error")) el("div", "dx-step", "no step: the placements are the same", box);
  const ol = el("ol", "dx-steps", null, box);
  steps.forEach((s, i) => {
    const li = el("li", "dx-step" + (i === model.get("step_index") ? " dx-current" : ""), stepText(s, i), ol);
    li.dataset.kind = s.kind;
    li.addEventListener("click", () => { model.set("step_index", i); model.save_changes(); });
  });
  if (steps.length) {
    const note = model.get("prediction_note");
    el("div", "dx-total", `predicted total: ${fmtSeconds(model.get("predicted_s"))}` + (note ? ` (${note})` : ""), box);
  }
}

function groupsOf(step) {
  const out = {};
  step.groups.forEach((g, i) => g.forEach((r) => { if (out[r] === undefined) out[r] = i; }));
  return out;
}

// the step stage: the ranks before the step, their groups, and the blocks that move
function stage(model, parent, state) {
  const box = el("div", "dx-stage", null, parent);
  const steps = model.get("steps");
  if (!steps.length) return;
  const i = Math.min(model.get("step_index"), steps.length - 1), step = steps[i];
  const bar = el("div", "dx-controls", null, box);
  const prev = el("button", "dx-prev", "◀", bar), play = el("button", "dx-play", "▶ play", bar);
  const next = el("button", "dx-next", "▶", bar);
  const slider = el("input", "dx-slider", null, bar);
  Object.assign(slider, { type: "range", min: 0, max: steps.length - 1, value: i });
  el("span", "dx-step-title", `step ${i + 1} of ${steps.length}: ${step.kind}`, bar);
  const go = (j) => { model.set("step_index", Math.max(0, Math.min(steps.length - 1, j))); model.save_changes(); };
  prev.addEventListener("click", () => go(i - 1));
  next.addEventListener("click", () => go(i + 1));
  slider.addEventListener("input", () => go(Number(slider.value)));
  play.addEventListener("click", () => { state.playing = true; state.animate(); });
  const { root, geo } = tilesSvg(model, step.layout_before, groupsOf(step));
  box.appendChild(root);
  const frames = model.get("frames")[i] || [];
  const list = el("div", "dx-transfers", null, box);
  if (!frames.length) list.textContent = step.collective ? "no block moves (empty shards)" : "local step: no block moves";
  frames.slice(0, 12).forEach((t) => el("div", "dx-transfer",
    `rank ${t.src} → rank ${t.dst}: ${regionText(t.offset, t.shape)}${t.reduces ? " (reduced into it)" : ""}`, list));
  if (frames.length > 12) el("div", "dx-transfer", `... ${frames.length - 12} more`, list);
  state.fly = () => fly(model, root, geo, frames);
}

// moves a copy of each transferred region from its sender's tile to its receiver's
function fly(model, root, geo, frames) {
  const shape = model.get("shape"), colors = model.get("colors"), ranks = model.get("ranks");
  const movers = [];
  for (const t of frames) {
    const a = geo[t.src], b = geo[t.dst];
    for (const q of blockRects(shape, t.offset, t.shape).slice(0, 16)) {
      const rect = svg("rect", { width: q.w * a.cell, height: q.h * a.cell, class: "dx-flying" + (t.reduces ? " dx-reducing" : ""),
        fill: colors[ranks.indexOf(t.src) % colors.length] }, root);
      movers.push({ rect, x0: a.ox + q.c * a.cell, y0: a.oy + q.r * a.cell, x1: b.ox + q.c * b.cell, y1: b.oy + q.r * b.cell });
    }
  }
  return new Promise((resolve) => {
    const start = performance.now();
    const tick = (now) => {
      const p = Math.min(1, (now - start) / FLY_MS), e = p * p * (3 - 2 * p);
      for (const m of movers) {
        m.rect.setAttribute("x", m.x0 + (m.x1 - m.x0) * e);
        m.rect.setAttribute("y", m.y0 + (m.y1 - m.y0) * e);
      }
      if (p < 1 && root.isConnected) requestAnimationFrame(tick);
      else resolve();
    };
    requestAnimationFrame(tick);
  });
}

function runRow(model, parent) {
  const row = el("div", "dx-run", null, parent);
  const button = el("button", "dx-run-button", model.get("running") ? "running..." : "run it on the cluster", row);
  button.disabled = model.get("running") || !!model.get("error");
  button.addEventListener("click", () => { model.send({ type: "run" }); button.textContent = "running..."; button.disabled = true; });
  const m = model.get("measured") || {};
  const out = el("span", "dx-measured", null, row);
  if (m.error) out.textContent = m.error;
  else if (m.seconds !== undefined) {
    const counts = Object.entries(m.counts || {}).map(([k, n]) => `${k} ×${n}`).join(", ") || "no collective";
    out.textContent = `measured ${fmtSeconds(m.seconds)}` +
      (m.comm_s !== undefined ? ` (in collectives ${fmtSeconds(m.comm_s)})` : "") +
      ` · ${counts} · predicted ${fmtSeconds(m.predicted_s)} · ` +
      (m.matches_torch ? "value equals torch's" : "VALUE DIFFERS FROM TORCH");
  }
}

function render({ model, el: root }) {
  const state = { playing: false };
  const view = el("div", "dx-explorer", null, root);
  state.animate = async () => {
    if (!state.fly) return;
    await state.fly();
    const i = model.get("step_index"), n = model.get("steps").length;
    if (state.playing && i + 1 < n) { model.set("step_index", i + 1); model.save_changes(); }
    else state.playing = false;
  };
  const draw = () => {
    view.replaceChildren();
    const shape = model.get("shape");
    el("div", "dx-title", `tensor (${shape.join(", ")}) ${model.get("dtype")} on mesh (${model.get("mesh_shape").join(", ")}) ` +
      `[${model.get("dim_names").join(", ")}]`, view);
    pickerRow(model, "src", "source", view);
    pickerRow(model, "dst", "target", view);
    if (model.get("error")) el("pre", "dx-error", model.get("error"), view);
    const layouts = el("div", "dx-layouts", null, view);
    layoutPanel(model, "src", "source", layouts);
    layoutPanel(model, "dst", "target", layouts);
    planList(model, view);
    state.fly = null;
    stage(model, view, state);
    runRow(model, view);
  };
  const redraw = () => { draw(); if (state.playing) state.animate(); };
  model.on("change:step_index", redraw);
  for (const name of ["steps", "frames", "layouts", "error", "measured", "running", "predicted_s", "src", "dst"]) {
    model.on(`change:${name}`, draw);
  }
  draw();
  return () => { state.playing = false; };
}

export default { render };
