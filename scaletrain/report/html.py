"""The report's one self-contained HTML page: plots embedded as data: URIs, inline style, no network access.

A small inline script marks <body data-loaded="all"> once every plot image has decoded, so a headless browser
(and the test) can tell a page whose images loaded from one that only has the tags.
"""

from __future__ import annotations

import base64
import html
import json
import time

import tomli_w

from scaletrain.report.plots import Plot
from scaletrain.report.runs import MISSING, Run, config_diff, number

MAX_EVENTS = 500  # per run; the rest stay in events.jsonl (a run with a memory snapshot per step has many)

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1600px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td:first-child { white-space: nowrap; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
figure { margin: 0; border: 1px solid #eee; padding: 4px; }
figcaption { font-size: 12px; color: #555; }
pre { background: #f8f8f8; padding: 8px; overflow-x: auto; font-size: 12px; }
.muted { color: #777; }
td.sample { font-family: monospace; white-space: pre-wrap; min-width: 40em; }
"""

LOADED_SCRIPT = """
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.querySelectorAll("img.plot"));
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute("data-images-ok", String(ok));
  document.body.setAttribute("data-loaded", ok === imgs.length ? "all" : "incomplete");
});
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: object) -> str:
    if value is None:
        return '<td class="muted">—</td>'
    if isinstance(value, float):
        return f'<td class="num">{value:.6g}</td>'
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<td class="num">{value}</td>'
    return f"<td>{_e(value)}</td>"


def _table(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _runs(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        last = run.metrics[-1]["step"] if run.metrics else None
        status = (
            f"ended at step {run.summary.get('steps')}"
            if run.summary
            else "no end event (running, or stopped)"
        )
        rows.append([run.name, str(run.path), last, status])
    return _table(["run", "directory", "last logged step", "status"], rows)


def _summary(runs: list[Run]) -> str:
    keys: list[str] = []
    for run in runs:
        keys += [k for k in (run.summary or {}) if k not in keys]
    if not keys:
        return '<p class="muted">No run has an end event yet, so there is no summary.</p>'
    rows = [[k, *[(run.summary or {}).get(k) for run in runs]] for k in keys]
    return _table(["", *[run.name for run in runs]], rows)


def _diff(runs: list[Run]) -> str:
    diff = config_diff([run.config for run in runs])
    if not diff:
        return '<p id="config-diff">The runs\' resolved configs are the same (apart from run.dir).</p>'
    rows = [[k, *[v if v is MISSING else _toml(v) for v in vs]] for k, vs in diff.items()]
    return '<div id="config-diff">' + _table(["key", *[run.name for run in runs]], rows) + "</div>"


def _toml(value: object) -> object:
    """A config value as a TOML file spells it (true, [0, 1], "text"; JSON's spelling of these is the same);
    numbers stay numbers for their cells."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    return json.dumps(value)


def _events(run: Run) -> str:
    if not run.events:
        return f"<h3>{_e(run.name)}</h3><p class='muted'>No events.jsonl, or it is empty.</p>"
    t0 = min((e["time"] for e in run.events if number(e.get("time")) is not None), default=0.0)
    rows = []
    for e in run.events[:MAX_EVENTS]:
        t = number(e.get("time"))
        details = ", ".join(f"{k}={_short(v)}" for k, v in e.items() if k not in ("time", "kind", "step"))
        rows.append([f"+{t - t0:.1f} s" if t is not None else None, e.get("step"), e.get("kind"), details])
    more = len(run.events) - MAX_EVENTS
    note = (
        f"<p class='muted'>{more} more event(s) in {_e(run.path / 'events.jsonl')}.</p>" if more > 0 else ""
    )
    return f"<h3>{_e(run.name)}</h3>" + _table(["time", "step", "kind", "details"], rows) + note


def _samples(run: Run) -> str:
    """The continuations of metrics.sample_prompt the run's checkpoints wrote (`scaletrain train`'s last lines)."""
    if not run.samples:
        return (
            f"<h3>{_e(run.name)}</h3><p class='muted'>No samples.jsonl: the run set no metrics.sample_prompt, "
            "or has not ended.</p>"
        )
    rows = []
    for s in run.samples:
        temperature = s.get("temperature")
        how = f"{temperature:g}" if isinstance(temperature, int | float) else temperature
        text = f"<b>{_e(s.get('prompt', ''))}</b>{_e(s.get('text', ''))}"
        cells = [s.get("checkpoint"), s.get("seed"), how, s.get("top_k")]
        rows.append("<tr>" + "".join(_cell(v) for v in cells) + f'<td class="sample">{text}</td></tr>')
    head = "".join(
        f"<th>{_e(h)}</th>" for h in ["checkpoint", "seed", "temperature", "top-k", "prompt → text"]
    )
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    return f"<h3>{_e(run.name)}</h3>" + table


def _short(value: object) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 200 else text[:200] + "…"


def _plots(plots: list[Plot]) -> str:
    out = []
    for p in plots:
        src = "data:image/png;base64," + base64.b64encode(p.png).decode("ascii")
        caption = _e(p.title) + ("" if p.has_data else " — no data in these runs")
        out.append(
            f'<figure><img class="plot" id="plot-{_e(p.name)}" alt="{_e(p.title)}" src="{src}">'
            f"<figcaption>{caption} ({_e(p.name)}.png)</figcaption></figure>"
        )
    return '<div class="plots">' + "".join(out) + "</div>"


def _configs(runs: list[Run]) -> str:
    out = []
    for run in runs:
        text = tomli_w.dumps(run.config) if run.config else "(config.toml is missing or unreadable)"
        out.append(f"<details><summary>{_e(run.name)}: config.toml</summary><pre>{_e(text)}</pre></details>")
    return "".join(out)


def render_page(runs: list[Run], plots: list[Plot]) -> str:
    """The whole page: runs, config differences (several runs), summary, plots, samples, events, resolved
    configs."""
    names = ", ".join(run.name for run in runs)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>scaletrain report: {_e(names)}</title><style>{STYLE}</style></head>",
        f'<body data-plots="{len(plots)}">',
        f"<h1>scaletrain report: {_e(names)}</h1>",
        f"<p class='muted'>Written {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}.</p>",
        _runs(runs),
    ]
    if len(runs) > 1:
        parts += ["<h2>Config differences</h2>", _diff(runs)]
    parts += ["<h2>Summary</h2>", _summary(runs), "<h2>Plots</h2>", _plots(plots), "<h2>Samples</h2>"]
    parts += [_samples(run) for run in runs]
    parts += ["<h2>Events</h2>"]
    parts += [_events(run) for run in runs]
    parts += [
        "<h2>Resolved config</h2>",
        _configs(runs),
        f"<script>{LOADED_SCRIPT}</script>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
