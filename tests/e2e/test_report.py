"""`scaletrain report` end to end: two short real runs (the first written with --metrics.report true, as `make
train` does), their pages opened in headless Chromium, and checked from the DOM it built and a screenshot."""

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from scaletrain.cli import main
from scaletrain.report.plots import COLOURS, PLOTS
from tests.helpers import events, train_cli

SHORT = dict(steps=6, training__eval_interval=3, metrics__log_interval=1, checkpoint__interval=3)
PLOT_NAMES = [name for name, *_ in PLOTS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished runs that differ in the learning rate only; the first printed its report when it ended."""
    root = tmp_path_factory.mktemp("report")
    a, b = root / "lr3e-3", root / "lr1e-3"
    trained = train_cli(a, **SHORT, metrics__report=True)
    train_cli(b, **SHORT, optimizer__lr="1e-3")
    return a, b, trained


def _chromium(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail(
            "chromium is not installed: apt-get install -y chromium (.ci/run installs it before the tests)"
        )
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--virtual-time-budget=5000"]
    return subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=120, check=True)


def _open(page: Path, shot: Path) -> str:
    """The DOM Chromium built from `page` (its scripts run), and a screenshot of it at `shot`."""
    profile = f"--user-data-dir={shot.parent / 'chromium-profile'}"
    _chromium(profile, "--window-size=1400,2000", f"--screenshot={shot}", page.as_uri())
    return _chromium(profile, "--dump-dom", page.as_uri()).stdout


def _check_rendered(dom: str, page: Path, shot: Path) -> None:
    """Every plot is an <img> whose data: URI holds that plot's PNG, the page's script saw each image decode
    (naturalWidth > 0), nothing is fetched from the network, and the screenshot shows a drawn page."""
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert f'data-images-ok="{len(PLOTS)}"' in body and 'data-loaded="all"' in body, body
    for name in PLOT_NAMES:
        img = re.search(rf'<img class="plot" id="plot-{name}"[^>]*src="data:image/png;base64,([^"]+)"', dom)
        assert img, f"plot {name} missing from the page"
        assert base64.b64decode(img.group(1)) == (page.parent / f"{name}.png").read_bytes()
    assert not re.search(r'(src|href)="(https?:)?//', dom) and "<link" not in dom
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 2000)
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 200, f"the screenshot has {len(colours)} colours: a blank or unstyled page?"
    white = max(n for n, c in colours if c == (255, 255, 255))
    assert white < 0.95 * image.size[0] * image.size[1]


def _pixels_of(png: Path, colour: str) -> int:
    rgb = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return sum(n for n, c in Image.open(png).convert("RGB").getcolors(1 << 20) if c == rgb)


def test_train_with_metrics_report_ends_by_printing_a_report_that_renders(runs, tmp_path):
    a, _, trained = runs
    page = a / "report" / "index.html"
    assert trained.stdout.strip().splitlines()[-1] == f"report: {page}"
    dom = _open(page, tmp_path / "one.png")
    _check_rendered(dom, page, tmp_path / "one.png")
    # The summary table is the run's end event; the event list names its checkpoints; the config is there.
    (end,) = events(a, "end")
    assert f"{end['final_loss']:.6g}" in dom and f"{end['final_val_loss']:.6g}" in dom
    assert dom.count("<td>checkpoint_saved</td>") == 2 and "config-diff" not in dom
    assert "[optimizer]" in dom and "lr = 0.003" in dom


def test_report_of_two_runs_overlays_them_and_lists_only_their_differences(runs, tmp_path, capsys):
    a, b, _ = runs
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "two")]) == 0
    page = tmp_path / "two" / "index.html"
    assert capsys.readouterr().out.strip() == f"report: {page}"
    dom = _open(page, tmp_path / "two.png")
    _check_rendered(dom, page, tmp_path / "two.png")
    diff = re.search(r'<div id="config-diff">(.*?)</div>', dom, re.S).group(1)
    rows = {r[0]: r[1:] for r in (re.findall(r"<td[^>]*>([^<]*)</td>", tr) for tr in diff.split("<tr>")) if r}
    assert rows == {"metrics.report": ["true", "false"], "optimizer.lr": ["0.003", "0.001"]}
    # The second run's curves are drawn in the second colour, over the first's; the one-run plot has none.
    assert _pixels_of(page.parent / "loss.png", COLOURS[1]) > 200
    assert _pixels_of(a / "report" / "loss.png", COLOURS[1]) == 0
