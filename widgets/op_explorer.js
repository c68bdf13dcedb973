// OpExplorer's view (anywidget ESM, after explorer_common.js): a picker per input per mesh
// dim; the rule's output placements, or the PlacementError with each fix (its redistributes,
// their collectives, bytes per rank, predicted time, the output once applied) and a button
// that applies it.

function setPlacement(model, input, dim, value) {
  const next = model.get("placements").map((p) => [...p]);
  next[input][dim] = value;
  model.set("placements", next);
  model.save_changes();
}

function pickers(model, parent) {
  const names = model.get("dim_names"), choices = model.get("choices");
  model.get("inputs").forEach((inp, i) => {
    const row = el("div", "dx-pickers", null, parent);
    el("span", "dx-side", `input ${i} (${inp.shape.join(", ")})`, row);
    names.forEach((name, d) => {
      const lab = el("label", "dx-pick-label", `${name} `, row);
      const sel = el("select", "dx-pick", null, lab);
      sel.dataset.input = i;
      sel.dataset.dim = d;
      for (const c of choices[i]) el("option", null, c, sel).value = c;
      sel.value = model.get("placements")[i][d];
      sel.addEventListener("change", () => setPlacement(model, i, d, sel.value));
    });
  });
}

function fixBox(model, fix, k, parent) {
  const box = el("div", "dx-fix", null, parent);
  const what = fix.changes.map((c) => `${c.label}.redistribute(placements=[${c.placements.join(", ")}])`).join(" and ");
  el("div", "dx-fix-title", `${k === 0 ? "fix" : "or"}: ${what}`, box);
  for (const c of fix.changes) {
    for (const s of c.steps) {
      const dim = s.mesh_dim_name || `dim ${s.mesh_dim}`;
      el("div", "dx-fix-steps", `  ${s.kind} on ${dim}: groups ${s.groups.map((g) => "(" + g.join(", ") + ")").join(" ")} · ${fmtBytes(s.bytes_per_rank)}/rank`, box);
    }
  }
  const out = fix.outputs ? fix.outputs.map((o) => "[" + o.join(", ") + "]").join(", ") : "still refused";
  el("div", "dx-fix-cost", `${fmtBytes(fix.bytes_per_rank)}/rank (${fix.kinds.join(", ") || "no data moves"}) · predicted ${fmtSeconds(fix.predicted_s)} · then the output is ${out}`, box);
  const apply = el("button", "dx-apply", "apply this fix", box);
  apply.addEventListener("click", () => {
    const next = model.get("placements").map((p) => [...p]);
    for (const c of fix.changes) next[c.input] = [...c.placements];
    model.set("placements", next);
    model.save_changes();
  });
}

function render({ model, el: root }) {
  const view = el("div", "dx-explorer dx-op", null, root);
  const draw = () => {
    view.replaceChildren();
    el("div", "dx-title", `${model.get("op")} on [${model.get("dim_names").join(", ")}]`, view);
    pickers(model, view);
    const outputs = model.get("outputs");
    if (outputs.length) {
      el("div", "dx-outputs", "output: " + outputs.map((o) => `(${o.shape.join(", ")}) [${o.placements.join(", ")}]`).join("; ") + " · no data moves", view);
    }
    if (model.get("error")) el("pre", "dx-error", model.get("error"), view);
    model.get("fixes").forEach((f, k) => fixBox(model, f, k, view));
  };
  for (const name of ["outputs", "error", "fixes", "placements"]) model.on(`change:${name}`, draw);
  draw();
}

export default { render };
