"""GET /: a small page to try the server: prompt, size, steps, seed and a generate button; it shows
the image, its seed and the time taken, with a progress indicator while it works. It calls the
same POST /v1/images/generations as any client (with the API key typed in, when the server has one)."""

from __future__ import annotations

import html
import json
from string import Template

from .config import ServeConfig

PAGE = Template("""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kasoku serve · $model</title>
<style>
  body { font: 15px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 46rem; padding: 0 1rem; color: #1d232a; }
  h1 { font-size: 1.35rem; margin-bottom: .2rem; }
  .sub { color: #5b6570; margin-top: 0; }
  form { display: grid; grid-template-columns: 7rem 1fr; gap: .55rem .8rem; align-items: center; }
  label { font-weight: 600; }
  textarea, input, select { font: inherit; padding: .35rem .45rem; border: 1px solid #b9c2cb; border-radius: 6px; }
  textarea { min-height: 4.2rem; resize: vertical; }
  button { grid-column: 2; justify-self: start; font: inherit; font-weight: 600; padding: .5rem 1.4rem;
           border: 0; border-radius: 6px; background: #1f6feb; color: #fff; cursor: pointer; }
  button:disabled { background: #8fb3ef; cursor: progress; }
  #progress { margin-top: 1.2rem; display: flex; gap: .8rem; align-items: center; }
  #progress progress { width: 16rem; }
  #result { margin: 1.2rem 0 0; }
  #result img { width: 256px; height: auto; image-rendering: pixelated; border-radius: 6px; border: 1px solid #d0d7de; }
  #result figcaption { margin-top: .4rem; color: #3d4650; }
  #error { margin-top: 1.2rem; color: #b42318; font-weight: 600; }
  [hidden] { display: none !important; }
</style>
</head>
<body>
<h1>kasoku serve</h1>
<p class="sub">$model · $backends · OpenAI Images API at <code>/v1/images/generations</code></p>
<script type="application/json" id="config">$config</script>
<form id="generate">
  <label for="prompt">Prompt</label>
  <textarea id="prompt" name="prompt" required>a photo of an astronaut riding a horse</textarea>
  <label for="size">Size</label>
  <select id="size" name="size">$size_options</select>
  <label for="steps">Steps</label>
  <input id="steps" name="steps" type="number" min="1" max="$max_steps" value="$steps">
  <label for="seed">Seed</label>
  <input id="seed" name="seed" type="number" min="0" placeholder="random">
  <label for="api-key" $key_hidden>API key</label>
  <input id="api-key" name="api-key" type="password" autocomplete="off" $key_hidden>
  <button id="go" type="submit">Generate</button>
</form>
<div id="progress" hidden role="status">
  <progress></progress><span>generating… <span id="elapsed">0.0 s</span></span>
</div>
<div id="error" hidden role="alert"></div>
<figure id="result" hidden>
  <img id="image" alt="the generated image">
  <figcaption>seed <strong id="seed-out"></strong> · <span id="time-out"></span></figcaption>
</figure>
<script>
(() => {
  const $$ = (id) => document.getElementById(id);
  const form = $$("generate"), button = $$("go"), progress = $$("progress"), elapsed = $$("elapsed");
  const error = $$("error"), result = $$("result");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const start = performance.now();
    const seconds = () => ((performance.now() - start) / 1000);
    button.disabled = true; error.hidden = true; progress.hidden = false;
    const timer = setInterval(() => { elapsed.textContent = seconds().toFixed(1) + " s"; }, 100);
    const body = { prompt: $$("prompt").value, size: $$("size").value, steps: Number($$("steps").value),
                   n: 1, response_format: "b64_json" };
    if ($$("seed").value !== "") body.seed = Number($$("seed").value);
    const headers = { "Content-Type": "application/json" };
    if ($$("api-key").value) headers.Authorization = "Bearer " + $$("api-key").value;
    try {
      const response = await fetch("/v1/images/generations", { method: "POST", headers, body: JSON.stringify(body) });
      const answer = await response.json().catch(() => ({}));
      if (!response.ok) throw new Error((answer.error && answer.error.message) || response.statusText);
      const image = answer.data[0];
      $$("image").src = "data:image/png;base64," + image.b64_json;
      $$("seed-out").textContent = image.seed;
      $$("time-out").textContent = seconds().toFixed(2) + " s";
      result.hidden = false;
    } catch (failure) {
      error.textContent = failure.message;
      error.hidden = false;
    } finally {
      clearInterval(timer);
      progress.hidden = true;
      button.disabled = false;
    }
  });
})();
</script>
</body>
</html>
""")


def render_page(config: ServeConfig, backends: str = "") -> str:
    sizes = "".join(f'<option value="{size}">{size}</option>' for size in config.sizes)
    facts = {"model": config.model_name, "sizes": [str(s) for s in config.sizes], "auth": config.api_key is not None}
    return PAGE.substitute(
        model=html.escape(config.model_name), backends=html.escape(backends or "engines loading"),
        config=json.dumps(facts).replace("<", "\\u003c"), size_options=sizes, max_steps=config.max_steps,
        steps=config.default_steps, key_hidden="" if config.api_key is not None else "hidden",
    )


__all__ = ["render_page"]
