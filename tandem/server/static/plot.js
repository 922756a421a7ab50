// A small line plot of tokens/s over time, drawn on a canvas (no library).

const SPAN_S = 120;

/** Draws `samples` ([{t, tokens_per_s}], t in unix seconds) ending at `now` onto `canvas`. */
export function drawPlot(canvas, samples, now) {
  const ratio = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth || canvas.width;
  const cssH = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(cssW * ratio)) {
    canvas.width = Math.round(cssW * ratio);
    canvas.height = Math.round(cssH * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);
  const left = 44, right = 8, top = 8, bottom = 20;
  const w = cssW - left - right, h = cssH - top - bottom;
  const shown = samples.filter((s) => now - s.t <= SPAN_S);
  const peak = Math.max(1, ...shown.map((s) => s.tokens_per_s));
  const ymax = niceCeil(peak);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#6b7280";
  ctx.strokeStyle = "#e5e7eb";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 2; i++) {
    const y = top + h - (h * i) / 2;
    ctx.beginPath();
    ctx.moveTo(left, y);
    ctx.lineTo(left + w, y);
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.fillText(String(Math.round((ymax * i) / 2)), left - 6, y);
  }
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  ctx.fillText(`-${SPAN_S} s`, left, top + h + 4);
  ctx.textAlign = "right";
  ctx.fillText("now", left + w, top + h + 4);
  if (!shown.length) return;
  const x = (t) => left + w - ((now - t) / SPAN_S) * w;
  const y = (v) => top + h - (v / ymax) * h;
  ctx.strokeStyle = "#2563eb";
  ctx.lineWidth = 2;
  ctx.beginPath();
  shown.forEach((s, i) => (i ? ctx.lineTo(x(s.t), y(s.tokens_per_s)) : ctx.moveTo(x(s.t), y(s.tokens_per_s))));
  ctx.stroke();
}

function niceCeil(v) {
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}
