"""``cokit dashboard``: reading telemetry (layouts, damaged lines), the panels' numbers, the
command's bad input, and the page itself in headless Chromium (console, panels, screenshot).

Telemetry comes from :func:`cokit.bench.dashboard_bench.write_synthetic_telemetry`, which
writes the ``cokit.telemetry/1`` schema record by record, plus hand-written files where the
exact numbers matter.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cokit.dashboard
from cokit.bench.dashboard_bench import write_synthetic_telemetry
from cokit.cli import main
from cokit.dashboard import figures, load_telemetry, render_html
from cokit.dashboard.axes import first_step_range, log_axis, step_range, sync_steps
from cokit.dashboard.panels import run_color
from cokit.dashboard.series import downsample, run_series

SCHEMA = "cokit.telemetry/1"
PANEL_KEYS = ("loss", "time", "bytes", "occupancy", "ranks", "tuner")


def _two_runs(root: Path, steps: int = 120, ranks: int = 2, **kw: Any) -> Path:
    write_synthetic_telemetry(root, "demo-DeMo", steps=steps, ranks=ranks, method="demo", seed=1, **kw)
    write_synthetic_telemetry(root, "demo-AdamW", steps=steps, ranks=ranks, method="adamw", seed=2, **kw)
    return root


def _rec(kind: str, rank: int = 0, world: int = 1, **fields: Any) -> str:
    rec = {"schema": SCHEMA, "kind": kind, "run": "hand", "rank": rank, "world_size": world, "time": 1.0}
    return json.dumps({**rec, **fields}) + "\n"


def _traces(panel) -> list[dict]:
    return [t.to_plotly_json() for t in panel.figure.data]


# ---------------------------------------------------------------------- reading
def test_synthetic_telemetry_follows_the_schema(tmp_path):
    """The generator writes what the Monitor writes (its schema check accepts every line)."""
    schema = pytest.importorskip("cokit.telemetry.schema")
    kinds: dict[str, int] = {}
    for path in write_synthetic_telemetry(tmp_path, "demo-DeMo", steps=20, ranks=2):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            schema.check_record(rec)
            kinds[rec["kind"]] = kinds.get(rec["kind"], 0) + 1
    assert kinds == {"meta": 2, "step": 40, "summary": 19, "end": 2}


def test_reads_all_three_layouts(tmp_path):
    root = _two_runs(tmp_path / "out", steps=30)
    for where, runs in (
        (root, {"demo-AdamW", "demo-DeMo"}),
        (root / "telemetry", {"demo-AdamW", "demo-DeMo"}),
        (root / "telemetry" / "demo-DeMo", {"demo-DeMo"}),
    ):
        tel = load_telemetry(where)
        assert {r.name for r in tel.runs} == runs
        for r in tel.runs:
            assert sorted(r.ranks) == [0, 1] and r.step_count == 30
            assert r.meta["method"] in ("demo", "adamw") and r.meta["config"]["steps"] == 30
            assert all(rank.end is not None for rank in r.ranks.values())
        assert tel.skipped_count == 0


def test_damaged_lines_are_skipped_and_counted(tmp_path, capsys):
    root = _two_runs(tmp_path / "out", steps=40)
    path = root / "telemetry" / "demo-DeMo" / "rank1.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[5] = lines[5][: len(lines[5]) // 2] + "\n"  # cut mid-record
    lines.insert(10, "\x00\x00garbage{{\n")
    lines.insert(11, "[1, 2, 3]\n")  # JSON, not a record
    lines.insert(12, json.dumps({"schema": "other/9", "kind": "step", "step": 3}) + "\n")
    lines.insert(13, _rec("step", rank=1, step="seven"))  # a step without an integer step
    lines.insert(14, _rec("future-kind", rank=1, whatever=1))  # unknown kind: ignored, not counted
    lines[-1] = lines[-1][:40]  # a killed writer's last line (the end record), no newline
    path.write_text("".join(lines))
    out = tmp_path / "page.html"
    assert main(["dashboard", str(root), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "skipped 6 unreadable telemetry line(s)" in err
    assert f"{path}: 6 line(s) skipped" in err and "not JSON (truncated or corrupt)" in err
    assert "schema 'other/9'" in err and "step record without an integer step" in err
    tel = load_telemetry(root)
    run = next(r for r in tel.runs if r.name == "demo-DeMo")
    assert len(run.ranks[1].steps) == 39  # one step record cut in half
    assert run.step_count == 40 and run.ranks[1].end is None  # the end record was the last line
    assert "6 unreadable line(s) skipped" in out.read_text()


@pytest.mark.parametrize("depth", [101, 1100, 200_000])
def test_a_line_nested_too_deep_is_skipped_like_any_malformed_line(tmp_path, capsys, depth):
    """JSON nested past MAX_DEPTH (100) is a malformed line, skipped and named by file and line;
    past ~1,000 levels Python's decoder ended the command in RecursionError. Brackets inside
    strings do not count, and a line exactly MAX_DEPTH deep is read."""
    from cokit.telemetry.schema import MAX_DEPTH

    folder = tmp_path / "out" / "telemetry" / "hand"
    folder.mkdir(parents=True)
    deep = '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}\n"
    at_limit = _rec(
        "meta", method="x", config={"n": json.loads("[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2))}
    )
    brackets_in_text = _rec("step", step=1, loss=1.0, note="[" * 5000 + "{" * 5000)
    path = folder / "rank0.jsonl"
    path.write_text(at_limit + _rec("step", step=0, loss=2.0) + deep + brackets_in_text)
    out = tmp_path / "page.html"
    assert main(["dashboard", str(tmp_path / "out"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{path}: 1 line(s) skipped (line 3: 1 nested deeper than {MAX_DEPTH} arrays/objects)" in err
    assert "Traceback" not in err and out.exists()
    log = load_telemetry(tmp_path / "out").runs[0].ranks[0]
    assert log.meta is not None and [r["step"] for r in log.steps] == [0, 1]


def test_inline_frame_keeps_the_page_itself_so_moving_the_file_breaks_nothing(tmp_path):
    """What notebooks show: an iframe whose srcdoc is the whole page (an IFrame of the file's
    path broke once the HTML moved); bad input is a clear error."""
    import html

    from cokit.dashboard import build_dashboard, inline_frame

    page = build_dashboard([_two_runs(tmp_path / "out", steps=10)], tmp_path / "page.html", log=None)
    text = page.read_text(encoding="utf-8")
    frame = inline_frame(page, height=500)
    page.rename(tmp_path / "moved.html")  # the output no longer needs the file
    assert frame.startswith('<iframe srcdoc="') and 'height="500"' in frame and " src=" not in frame
    assert html.unescape(frame.split('"')[1]) == text  # the attribute holds the page exactly
    with pytest.raises(FileNotFoundError, match="build_dashboard"):
        inline_frame(page)
    for bad in (0, True, 720.0, 10**6):
        with pytest.raises(ValueError, match="height must be an integer from 100 to 10000"):
            inline_frame(tmp_path / "moved.html", height=bad)


def test_nan_literals_and_unknown_keys_are_tolerated(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    text = _rec("meta", method="x", extra_new_key={"a": 1})
    text += _rec(
        "step", step=0, step_s=None, loss=float("nan"), comm=None, kernels=[], tuner=[], new={"k": 2}
    )
    text += _rec("step", step=1, step_s=0.5, loss=2.0, comm=None)
    text += _rec("step", step=2, step_s=float("inf"), loss=3.0).replace("Infinity", "1e999")
    (folder / "rank0.jsonl").write_text(text)
    tel = load_telemetry(folder)
    s = run_series(tel.runs[0])
    assert np.isnan(s.mean("loss")[0]) and s.mean("loss")[1] == 2.0
    assert np.isnan(s.mean("step_s")[2]) and s.mean("loss")[2] == 3.0  # 1e999 parses as inf
    assert tel.skipped_count == 0


def test_out_of_range_numbers_are_skipped_and_counted(tmp_path, capsys):
    """Numbers no array holds (a step of 10**30, an int beyond float64) skip their record, like
    any malformed line; the page is still written with the good records drawn."""
    folder = tmp_path / "out" / "telemetry" / "hand"
    folder.mkdir(parents=True)
    good = [_rec("meta", method="x")]
    good += [_rec("step", step=i, step_s=0.1 * (i + 1), loss=5.0 - i) for i in range(4)]
    good += [_rec("summary", step=2, slowest_rank=0), _rec("end", steps=4, wall_s=1.5)]
    bad = [
        _rec("step", step=10**30, step_s=0.1, loss=1.0),
        _rec("step", step=2**63, loss=1.0),
        _rec("step", step=-1, loss=1.0),
        _rec("step", step=9, step_s=10**400, loss=1.0),  # an int no float64 holds
        _rec("step", step=9, loss=1.0, comm={"sent_bytes": 10**400}),
        _rec("step", step=9, loss=1.0, kernels=[{"name": "k", "blocks_per_sm": -(10**999)}]),
        _rec("step", world=10**30, step=9, loss=1.0),
        _rec("summary", step=10**30, slowest_rank=0),
        _rec("summary", step=3, slowest_rank=10**400),
        _rec("end", steps=4, wall_s="1.5 s"),
        _rec("end", steps=4, wall_s=1.0).replace('"wall_s": 1.0', '"wall_s": 1e999'),
        _rec("step", step=9, loss=1.0).replace('"step": 9', '"step": ' + "9" * 5000),  # > int()'s limit
    ]
    lines = good[:3] + bad[:6] + good[3:5] + bad[6:] + good[5:]
    (folder / "rank0.jsonl").write_text("".join(lines))
    out = tmp_path / "page.html"
    assert main(["dashboard", str(tmp_path / "out"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"skipped {len(bad)} unreadable telemetry line(s)" in err, err
    for why in ("step out of range", "beyond float64's range", "world_size out of range", "wall_s"):
        assert why in err, why
    assert f"{len(bad)} unreadable line(s) skipped" in out.read_text()
    tel = load_telemetry(folder)
    log = tel.runs[0].ranks[0]
    assert [r["step"] for r in log.steps] == [0, 1, 2, 3] and log.world_size == 1
    assert [r["step"] for r in log.summaries] == [2] and log.end is not None and log.end["wall_s"] == 1.5
    loss = next(p for p in figures(tel) if p.key == "loss")
    ys = [list(t["y"]) for t in _traces(loss) if t.get("legendgroup") == "hand" and t.get("y") is not None]
    assert [5.0, 4.0, 3.0, 2.0] in ys, ys


# ---------------------------------------------------------------------- numbers
def test_series_derives_compute_hidden_and_fractions(tmp_path):
    folder = tmp_path / "hand"
    folder.mkdir()
    comm = {
        "encode_s": 0.1,
        "decode_s": 0.1,
        "exposed_s": 0.2,
        "comm_s": 0.5,
        "sent_bytes": 100,
        "dense_bytes": 1000,
    }
    for rank in (0, 1):
        text = _rec("meta", rank=rank, world=2)
        # step 0: compute_s given; step 1: derived from step - encode - decode - exposed
        text += _rec("step", rank=rank, world=2, step=0, step_s=1.0, compute_s=0.6, comm=comm)
        text += _rec(
            "step",
            rank=rank,
            world=2,
            step=1,
            step_s=1.0 + rank,
            compute_s=None,
            comm={**comm, "comm_s": 0.1},
        )
        (folder / f"rank{rank}.jsonl").write_text(text)
    s = run_series(load_telemetry(folder).runs[0])
    np.testing.assert_allclose(s.compute_s(), [0.6, (0.6 + 1.6) / 2])
    np.testing.assert_allclose(s.hidden_comm_s(), [0.3, 0.0])  # comm < exposed clamps at 0
    np.testing.assert_allclose(s.exposed_fraction(), [0.2, (0.2 + 0.1) / 2])
    np.testing.assert_allclose(s.cumulative_sent(), [100, 200])
    # no summary records: the slowest rank comes from the files (rank 1 at step 1; tie at 0 -> first)
    assert not s.slowest_from_summary and list(s.slowest_rank) == [0, 1]


def test_downsample_averages_buckets_and_keeps_sparse_points():
    x = np.arange(10)
    y = np.arange(10, dtype=float)
    sparse = np.full(10, np.nan)
    sparse[7] = 5.0
    xs, (ys, ss), k = downsample(x, [y, sparse], 4)
    assert k == 3 and list(xs) == [0, 3, 6, 9]
    np.testing.assert_allclose(ys, [1, 4, 7, 9])
    assert np.isnan(ss[:2]).all() and ss[2] == 5.0
    same, (y2,), k1 = downsample(x, [y], 10)
    assert k1 == 1 and same is x and y2 is y


def test_panels_overlay_runs_with_one_color_each(tmp_path):
    a = _two_runs(tmp_path / "a", steps=60)
    b = tmp_path / "b"
    write_synthetic_telemetry(b, "demo-DeMo", steps=50, ranks=3, seed=5)
    panels = {p.key: p for p in figures(load_telemetry([a, b]))}
    assert tuple(panels) == PANEL_KEYS
    labels = ["demo-AdamW", "a/demo-DeMo", "b/demo-DeMo"]  # same run name in two RUN_DIRs
    for key in ("loss", "bytes", "ranks", "tuner"):
        groups = {t["legendgroup"] for t in _traces(panels[key])}
        assert set(labels) <= groups, key
    for i, label in enumerate(labels):
        colors = {
            t["line"]["color"]
            for key in ("loss", "bytes", "tuner")
            for t in _traces(panels[key])
            if t.get("legendgroup") == label and "line" in t and t.get("mode") != "markers"
        }
        assert colors == {run_color(i)}, label
    ranks = [t["name"] for t in _traces(panels["ranks"]) if t["name"].startswith("b/demo-DeMo rank")]
    assert ranks == ["b/demo-DeMo rank 0", "b/demo-DeMo rank 1", "b/demo-DeMo rank 2"]
    assert "rank 2 slowest on" in panels["ranks"].note and "summary records" in panels["ranks"].note
    # one step-time split per run, hidden communication drawn for each
    split = _traces(panels["time"])
    assert sum(t["name"].startswith("hidden communication") for t in split) == 3
    # tuner markers: explore, trial, lock, drift for each run
    events = {t["name"] for t in _traces(panels["tuner"]) if t["mode"] == "markers"}
    assert {f"demo-AdamW {e}" for e in ("explore", "trial", "lock", "drift")} <= events
    assert "no kernel configs recorded" not in panels["occupancy"].note


def test_missing_kernels_and_tuner_say_so(tmp_path):
    root = tmp_path / "r"
    write_synthetic_telemetry(root, "plain", steps=20, ranks=1, kernels=False, tuner=False)
    panels = {p.key: p for p in figures(root)}
    assert panels["occupancy"].note == "no kernel configs recorded"
    assert panels["tuner"].note == "no tuner decisions recorded"
    texts = {a.text for key in ("occupancy", "tuner") for a in panels[key].figure.layout.annotations}
    assert {"no kernel configs recorded", "no tuner decisions recorded"} <= texts


def test_long_runs_are_averaged_to_the_points_budget(tmp_path):
    root = _two_runs(tmp_path / "r", steps=300, ranks=1, tuner=False)
    tel = load_telemetry(root)
    panels = figures(tel, max_points=100)
    for p in panels:
        for t in _traces(p):
            x = t.get("x")
            n = len(x) if x is not None and not isinstance(x, dict) else 0
            assert n <= 101, (p.key, t["name"], n)
    assert "to at most 100 points each" in render_html(tel, max_points=100)
    assert "averaged over consecutive steps" not in render_html(tel)


# ---------------------------------------------------------------------- the command
def test_command_writes_an_offline_page_into_the_first_run_dir(tmp_path, capsys):
    root = _two_runs(tmp_path / "out", steps=50)
    assert main(["dashboard", str(root)]) == 0
    page = root / "dashboard.html"
    assert f"wrote {page}" in capsys.readouterr().out
    text = page.read_text()
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I), "a script loaded from elsewhere"
    assert not re.search(r"<link[^>]*href\s*=\s*['\"]?https?:", text, re.I)
    assert text.count("<script type='text/javascript'>") == 1  # plotly.js, inline, once
    for key in PANEL_KEYS:
        assert f'id="panel-{key}"' in text and f'id="plot-{key}"' in text
    assert "demo-DeMo" in text and "topk=32" in text  # header: runs and their settings
    # a second run refuses to replace it; --overwrite does
    assert main(["dashboard", str(root)]) == 2
    assert "already exists" in capsys.readouterr().err and page.read_text() == text
    assert main(["dashboard", str(root), "--overwrite", "--title", "second"]) == 0
    assert "<title>second</title>" in page.read_text()


def test_empty_run_dir_is_exit_2_with_a_message(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "telemetry" / "run").mkdir(parents=True)
    assert main(["dashboard", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "cokit dashboard: error: nothing to show: no telemetry/<run>/rank<r>.jsonl files in"
    )
    assert not (empty / "dashboard.html").exists()


def test_only_unreadable_lines_is_exit_2(tmp_path, capsys):
    folder = tmp_path / "out" / "telemetry" / "broken"
    folder.mkdir(parents=True)
    (folder / "rank0.jsonl").write_text('{"schema": "cokit.tel\nnot json at all\n')
    assert main(["dashboard", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nothing to show: every line of 1 file(s) was unreadable" in err and "2 line(s) skipped" in err
    assert not (tmp_path / "out" / "dashboard.html").exists()


def test_missing_run_dir_is_refused_before_anything_is_written(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["dashboard", str(missing)]) == 2
    assert f"RUN_DIR {missing} does not exist" in capsys.readouterr().err
    assert not missing.exists()  # the default --out did not create it


@pytest.mark.parametrize("kind", ["under-a-file", "proc", "a-folder"])
def test_unusable_out_is_refused_before_reading(tmp_path, capsys, monkeypatch, kind):
    root = _two_runs(tmp_path / "runs", steps=10)

    def read(*args, **kwargs):
        raise AssertionError("telemetry was read although --out is unusable")

    monkeypatch.setattr(cokit.dashboard, "load_telemetry", read)
    if kind == "under-a-file":
        (tmp_path / "file").write_text("x")
        out, expect = tmp_path / "file" / "d.html", "is a file, not a folder"
    elif kind == "proc":
        out, expect = Path("/proc") / f"cokit-test-{tmp_path.name}" / "d.html", "is not writable"
    else:
        out, expect = tmp_path, "is a folder; give a file name"
    assert main(["dashboard", str(root), "--out", str(out)]) == 2
    assert expect in capsys.readouterr().err


# ---------------------------------------------------------------------- the browser
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


class DevTools:
    """A minimal Chrome DevTools Protocol client over ``--remote-debugging-pipe`` (fd 3: our
    commands, fd 4: its replies and events, NUL-separated JSON), stdlib only."""

    def __init__(self, binary: str, profile: Path, width: int = 1400, height: int = 1000) -> None:
        cmd_r, self._cmd_w = os.pipe()
        self._evt_r, evt_w = os.pipe()
        # the child's ends, moved above 9 so that making them fds 3 and 4 cannot clobber them
        hi_r, hi_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_r, evt_w))
        os.close(cmd_r)
        os.close(evt_w)

        def fds() -> None:  # in the child, before exec: dup2 gives inheritable fds 3 and 4
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        profile.mkdir(parents=True, exist_ok=True)
        self.log_path = profile / "chromium.log"  # a file, not a pipe: a chatty browser never blocks
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--disable-gpu",
                "--no-sandbox",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            preexec_fn=fds,
            close_fds=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        os.close(hi_r)
        os.close(hi_w)
        self._next = 0
        self._messages: queue.Queue[dict] = queue.Queue()
        self.events: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._evt_r, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            *whole, buf = buf.split(b"\0")
            for raw in whole:
                self._messages.put(json.loads(raw))

    def send(
        self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60
    ) -> dict:
        """Send a command and wait for its reply (events meanwhile go to ``events``)."""
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            raise RuntimeError(f"chromium exited ({self.proc.poll()}): {self.log_tail()}") from None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply to {method} in {timeout} s; chromium's log: {self.log_tail()}")
            try:
                reply = self._messages.get(timeout=left)
            except queue.Empty:
                continue
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def log_tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-2000:]

    def wait_event(self, method: str, since: int = 0, timeout: float = 60) -> dict:
        """The first ``method`` event at or after index ``since`` of ``events``."""
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events[since:]:
                if e.get("method") == method:
                    return e
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {method} event in {timeout} s")
            try:
                self.events.append(self._messages.get(timeout=left))
            except queue.Empty:
                continue

    def close(self) -> None:
        try:
            os.write(self._cmd_w, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._cmd_w)
            os.close(self._evt_r)
            self._log.close()


PANEL_PROBE = """JSON.stringify(Array.from(document.querySelectorAll('section.panel')).map(s => {
  const plot = s.querySelector('.js-plotly-plot');
  const r = plot ? plot.getBoundingClientRect() : null;
  return {id: s.id, svg: plot ? plot.querySelectorAll('.main-svg').length : 0,
          traces: plot ? plot.querySelectorAll('.scatterlayer .trace').length : 0,
          data: plot && plot.data ? plot.data.length : 0,
          text: plot ? plot.textContent : '',
          rect: r ? [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height] : null};
}))"""
CONSOLE_ERRORS = ("error", "assert")


def _hex(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def _errors(events: list[dict]) -> list[dict]:
    """Uncaught exceptions, console.error/assert calls and error log entries among ``events``."""
    return [
        e["params"]
        for e in events
        if e.get("method") == "Runtime.exceptionThrown"
        or (e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") in CONSOLE_ERRORS)
        or (e.get("method") == "Log.entryAdded" and e["params"]["entry"].get("level") == "error")
    ]


def _session(browser: DevTools) -> str:
    """A blank tab with the Runtime, Log and Page events on; its session id."""
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime", "Log", "Page"):
        browser.send(f"{domain}.enable", session=session)
    return session


def _open(browser: DevTools, session: str, page: Path, width: int = 1400) -> tuple[list[dict], int]:
    """Load ``page``, wait until plotly drew every panel, size the viewport to the whole page;
    returns the panels' probe and the index of the page's first event."""
    since = len(browser.events)
    browser.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
    browser.wait_event("Page.loadEventFired", since=since, timeout=90)
    deadline = time.monotonic() + 60

    def probe() -> list[dict]:
        res = browser.send("Runtime.evaluate", {"expression": PANEL_PROBE, "returnByValue": True}, session)
        return json.loads(res["result"]["value"])

    while True:  # plotly draws on load; wait until every panel has its SVG
        panels = probe()
        if (panels and all(p["svg"] for p in panels)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    height = int(browser.send("Page.getLayoutMetrics", session=session)["cssContentSize"]["height"]) + 20
    browser.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        session,
    )
    time.sleep(0.5)  # the resize settles; late console messages arrive
    return probe(), since


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_page_renders_in_headless_chromium(tmp_path):
    """The page loads offline with no console errors, every panel draws all its traces, and a
    full-page screenshot shows each panel non-blank and in the runs' colors; a page without
    kernel configs or tuner decisions says so in those panels."""
    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    from PIL import Image

    page = cokit.dashboard.build_dashboard(
        [_two_runs(tmp_path / "runs", steps=150)], tmp_path / "a.html", log=None
    )
    plain = tmp_path / "plain"
    write_synthetic_telemetry(plain, "plain", steps=40, ranks=1, kernels=False, tuner=False)
    page_plain = cokit.dashboard.build_dashboard([plain], tmp_path / "b.html", log=None)
    browser = DevTools(binary, tmp_path / "profile")
    try:
        session = _session(browser)
        panels, since = _open(browser, session, page)
        shot = browser.send(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session
        )
        errors_a = _errors(browser.events[since:])
        panels_plain, since = _open(browser, session, page_plain)
        errors_b = _errors(browser.events[since:])
        # the listener works: an error logged now is seen (so none above means none happened)
        since = len(browser.events)
        browser.send("Runtime.evaluate", {"expression": "console.error('cokit-probe'); 1"}, session)
        browser.send("Runtime.evaluate", {"expression": "1"}, session)
        probe = _errors(browser.events[since:])
    finally:
        browser.close()
    png = tmp_path / "dashboard.png"
    png.write_bytes(base64.b64decode(shot["data"]))
    if os.environ.get("COKIT_DASHBOARD_SCREENSHOT"):  # keep a copy to look at
        shutil.copy(png, os.environ["COKIT_DASHBOARD_SCREENSHOT"])

    assert errors_a == [] and errors_b == [], f"console errors: {errors_a + errors_b}"
    assert len(probe) == 1 and probe[0]["args"][0]["value"] == "cokit-probe"
    for found in (panels, panels_plain):
        assert [p["id"] for p in found] == [f"panel-{k}" for k in PANEL_KEYS]
        for p in found:
            assert p["svg"] >= 1 and p["traces"] >= 1 and p["traces"] == p["data"], p
            assert p["rect"][2] > 600 and p["rect"][3] > 300, p
    plain_text = {p["id"]: p["text"] for p in panels_plain}
    assert "no kernel configs recorded" in plain_text["panel-occupancy"]
    assert "no tuner decisions recorded" in plain_text["panel-tuner"]
    assert "no kernel configs recorded" not in {p["id"]: p["text"] for p in panels}["panel-occupancy"]

    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert image.shape[1] == 1400 and image.shape[0] >= max(p["rect"][1] + p["rect"][3] for p in panels) - 2
    run_rgb = [_hex(run_color(0)), _hex(run_color(1))]
    for p in panels:
        x, y, w, h = (round(v) for v in p["rect"])
        region = image[y : y + h, x : x + w]
        ink = (region < 235).any(axis=2).mean()
        assert ink > 0.02, f"{p['id']} looks blank ({ink:.1%} non-white)"
        want = [_hex("#4c78a8")] if p["id"] == "panel-time" else run_rgb  # the compute band
        for rgb in want:
            close = (np.abs(region - np.asarray(rgb)).max(axis=2) < 30).sum()
            assert close > 100, f"{p['id']}: only {close} pixels in {rgb}"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_overlap_demo_fills_the_kernel_and_tuner_panels(tmp_path, monkeypatch):
    """``cokit demo --overlap`` records the configs in use on every step and the tuner's decisions
    on every rank; its dashboard, in headless Chromium, shows them (no "nothing recorded" note)
    and says that on CPU the configs change no timing."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "demo"
    argv = ["demo", "--overlap", "--methods", "demo", "--model", "toy", "--steps", "16", "--eval-every", "8"]
    argv += ["--batch-size", "4", "--max-chars", "200000", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    assert json.loads((out / "demo.json").read_text())["config"]["overlap"] is True
    for rank in (0, 1):
        lines = (out / "telemetry" / "demo-DeMo" / f"rank{rank}.jsonl").read_text().splitlines()
        steps = [r for r in map(json.loads, lines) if r["kind"] == "step"]
        assert len(steps) == 16 and all(len(r["kernels"]) >= 4 for r in steps)
        assert any(d["event"] == "lock" for r in steps for d in r["tuner"])
    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    page = cokit.dashboard.build_dashboard([out], tmp_path / "overlap.html", log=None)
    browser = DevTools(binary, tmp_path / "profile")
    try:
        session = _session(browser)
        panels, since = _open(browser, session, page)
        errors = _errors(browser.events[since:])
        section = browser.send(
            "Runtime.evaluate",
            {"expression": "document.querySelector('#panel-occupancy').textContent", "returnByValue": True},
            session,
        )["result"]["value"]
    finally:
        browser.close()
    assert errors == [], errors
    text = {p["id"]: p["text"] for p in panels}
    for key in ("panel-occupancy", "panel-tuner"):
        assert (
            "no kernel configs recorded" not in text[key] and "no tuner decisions recorded" not in text[key]
        )
    assert "linear K32xN" in text["panel-occupancy"] and "lock" in text["panel-occupancy"]
    assert "ran on CPU" in section and "change no timing" in section


def test_without_plotly_the_command_says_what_to_install(tmp_path):
    """plotly is an optional extra: without it `cokit dashboard` exits 2 with one line naming
    the install, and `import cokit` (the library) works."""
    _two_runs(tmp_path / "runs", steps=5)
    code = (
        "import sys; sys.modules['plotly'] = None; import cokit, cokit.compress, cokit.telemetry; "
        "from cokit.cli import main; sys.exit(main(['dashboard', sys.argv[1]]))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "runs")], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and "pip install 'cokit[dashboard]'" in lines[0], res.stderr
    assert not (tmp_path / "runs" / "dashboard.html").exists()


# ---------------------------------------------------------------------- axes
def test_axis_decisions_on_plain_arrays():
    """Log when a range spans more than a decade; syncs when most steps send nothing; the
    shared step range; a first-step outlier's range from the later steps."""
    assert log_axis([np.array([1.0, 2.0]), np.array([60.0, np.nan])])
    assert not log_axis([np.array([1.0, 2.0, 9.0]), np.array([0.0, -5.0])])  # zeros, negatives ignored
    assert not log_axis([np.array([np.nan])]) and not log_axis([])
    sent = np.array([0, 0, 0, 500, 0, 0, 0, 510, np.nan], dtype=float)
    assert list(sync_steps(sent)) == [False] * 3 + [True] + [False] * 3 + [True, False]
    assert sync_steps(np.array([100.0, 0, 120, 110])) is None  # sends on most steps
    assert sync_steps(np.zeros(5)) is None and sync_steps(np.full(3, np.nan)) is None
    assert step_range([np.arange(0, 101), np.arange(5, 50)]) == [-1.0, 101.0]
    assert step_range([np.array([3])]) == [2.5, 3.5] and step_range([np.zeros(0)]) is None
    rng = np.random.default_rng(0)
    later = 30 + rng.normal(0, 1, 200)
    found = first_step_range([np.concatenate([[300.0], later]), 31 + rng.normal(0, 1, 200)])
    assert found is not None and found[1] == 300.0
    lo, hi = found[0]
    assert 20 < lo < 29 and 32 < hi < 40, found
    assert first_step_range([np.concatenate([[300.0], later])], from_zero=True)[0][0] == 0.0
    assert first_step_range([np.concatenate([[35.0], later])]) is None  # no outlier
    assert first_step_range([np.array([300.0, 30.0])]) is None  # too few later steps


def _sync_runs(root: Path, steps: int = 120) -> Path:
    """DeMo with a 300 ms first step, AdamW, and a SparseLoCo-like run syncing every 10 steps."""
    write_synthetic_telemetry(root, "demo-DeMo", steps=steps, ranks=2, seed=1, first_step_s=0.3)
    write_synthetic_telemetry(root, "demo-AdamW", steps=steps, ranks=2, method="adamw", seed=2)
    write_synthetic_telemetry(
        root, "sparseloco", steps=steps, ranks=2, method="sparseloco", seed=3, sync_every=10
    )
    return root


def test_syncs_are_markers_log_axes_and_first_step_range(tmp_path):
    """SparseLoCo's bytes and ratio are drawn at its syncs only (no line through zeros, no
    sawtooth); bytes and ratio axes are log; the time plots' initial y range leaves DeMo's
    300 ms first step out (the point stays) and the notes say so; every step axis starts from
    the same range and has spikelines, the loss against wall time and bytes are not linked."""
    panels = {p.key: p for p in figures(_sync_runs(tmp_path / "r"))}
    fig = panels["bytes"].figure
    syncs = {t.name: t for t in fig.data if t.legendgroup == "sparseloco"}
    sent, ratio = syncs["sparseloco sent (syncs)"], syncs["sparseloco ratio (syncs)"]
    assert sent.mode == "markers" and list(sent.x) == list(range(9, 120, 10)) and min(sent.y) > 0
    assert ratio.mode == "lines+markers" and list(ratio.x) == list(sent.x)
    assert max(ratio.y) / min(ratio.y) < 1.05  # cumulative at the syncs: flat, no spike
    assert syncs["sparseloco dense"].mode == "lines" and len(syncs["sparseloco dense"].x) == 120
    demo = next(t for t in fig.data if t.name == "demo-DeMo sent")
    assert demo.mode == "lines" and len(demo.x) == 120
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"  # 1x .. 150x
    assert "sparseloco send(s) bytes only at syncs" in panels["bytes"].note
    # only DeMo and AdamW: ratios 1..60 still span more than a decade; one run alone does not
    alone = {p.key: p for p in figures(_two_runs(tmp_path / "two", steps=40))}
    assert alone["bytes"].figure.layout.yaxis2.type == "log"
    one = tmp_path / "one"
    write_synthetic_telemetry(one, "demo-DeMo", steps=40, ranks=1)
    assert {p.key: p for p in figures(one)}["bytes"].figure.layout.yaxis2.type == "linear"
    # the first step: out of the initial y range, still in the data
    for key, yaxis in (("time", "yaxis2"), ("ranks", "yaxis"), ("tuner", "yaxis")):  # time: row 2 is DeMo
        f = panels[key].figure
        assert "first step (30" in panels[key].note and "compile/warm-up" in panels[key].note, key
        top = f.layout[yaxis].range[1]
        assert 30 < top < 100 and f.layout[yaxis].autorange is False, (key, top)
        on = [np.nanmax(np.asarray(t.y, dtype=float)) for t in f.data if t.yaxis in (None, "y" + yaxis[5:])]
        assert max(on) > 250, key
    assert panels["time"].figure.layout.yaxis.range is None  # AdamW's first step is no outlier
    assert "first step" not in alone["ranks"].note and alone["ranks"].figure.layout.yaxis.range is None
    # the shared step axis
    assert panels["loss"].step_axes == ("xaxis",)
    assert panels["occupancy"].step_axes == tuple(f"xaxis{i}" if i > 1 else "xaxis" for i in range(1, 6))
    for p in panels.values():
        for name in p.step_axes:
            ax = p.figure.layout[name]
            assert tuple(ax.range) == (-1.19, 120.19) and ax.showspikes, (p.key, name)
    loss = panels["loss"].figure.layout
    assert loss.xaxis2.range is None and loss.xaxis3.range is None and not loss.xaxis2.showspikes


LINK_PROBE = """(async () => {
  const link = window.cokitStepAxes;
  const plot = id => document.getElementById(id);
  const ranges = () => Object.fromEntries(Object.keys(link).map(id => [id, Object.fromEntries(
      Object.keys(plot(id).layout).filter(k => /^xaxis\\d*$/.test(k))
        .map(k => [k, plot(id).layout[k].range]))]));
  const settle = () => new Promise(done => setTimeout(done, 400));
  const out = {link, range: window.cokitStepRange, calls: []};
  const relayout = Plotly.relayout;
  let calls = 0;  // relayouts, the page's own included: a feedback loop would never stop
  Plotly.relayout = function () { calls++; return relayout.apply(this, arguments); };
  await Plotly.relayout(plot('plot-loss'), {'xaxis.range': [A, B]});  // zoom the first step panel
  await settle();
  out.zoomed = ranges();
  out.calls.push(calls);
  await settle();
  out.calls.push(calls);
  await Plotly.relayout(plot('plot-bytes'), {'xaxis2.autorange': true});  // reset another one
  await settle();
  out.reset = ranges();
  await settle();
  out.calls.push(calls);
  // hover step 40 on one panel, as the mouse does (an event with a target emits plotly_hover)
  const drag = plot('plot-time').querySelector('.draglayer .xy .nsewdrag');
  const box = drag.getBoundingClientRect();
  const mouse = {xval: 40, target: drag, clientX: box.left + box.width / 2, clientY: box.top + box.height / 2};
  Plotly.Fx.hover(plot('plot-time'), mouse, 'xy');
  await settle();
  out.hovered = Object.fromEntries(Object.keys(link).map(id => [id, (plot(id)._hoverdata || []).map(p => p.x)]));
  return JSON.stringify(out);
})()"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_step_axes_zoom_reset_and_hover_together_in_chromium(tmp_path):
    """In headless Chromium: zooming the first step panel gives every step axis of every panel
    (each shared subplot axis too) the same range, and nothing else (loss against wall time and
    bytes keep theirs); resetting another panel returns all of them to the shared initial range;
    hovering a step on one panel hovers that step on the others; no console errors."""
    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    page = cokit.dashboard.build_dashboard([_sync_runs(tmp_path / "runs")], tmp_path / "a.html", log=None)
    a, b = 20.5, 60.25
    browser = DevTools(binary, tmp_path / "profile")
    try:
        session = _session(browser)
        panels, since = _open(browser, session, page)
        expr = LINK_PROBE.replace("[A, B]", f"[{a}, {b}]")
        res = browser.send(
            "Runtime.evaluate", {"expression": expr, "awaitPromise": True, "returnByValue": True}, session
        )
        errors = _errors(browser.events[since:])
    finally:
        browser.close()
    assert errors == [], errors
    assert all(p["svg"] >= 1 and p["traces"] >= 1 for p in panels), panels
    assert "exceptionDetails" not in res, res
    out = json.loads(res["result"]["value"])
    link = out["link"]
    assert set(link) == {f"plot-{k}" for k in PANEL_KEYS}
    assert link["plot-loss"] == {"axes": ["xaxis"], "subplots": ["xy"]}
    assert link["plot-occupancy"]["subplots"] == ["xy", "x2y2", "x3y3", "x4y4", "x5y5"]
    assert out["range"] == [-1.19, 120.19]
    for state, want in (("zoomed", [a, b]), ("reset", out["range"])):
        for plot, axes in link.items():
            for ax in axes["axes"]:
                np.testing.assert_allclose(
                    out[state][plot][ax], want, atol=1e-6, err_msg=f"{state} {plot} {ax}"
                )
    # zoom: the test's call and one per other figure; reset: the test's and one per figure
    assert out["calls"] == [6, 6, 13], out["calls"]
    for ax in ("xaxis2", "xaxis3"):  # loss against wall time and bytes: not step axes
        assert not np.allclose(out["zoomed"]["plot-loss"][ax], [a, b]), out["zoomed"]["plot-loss"]
    for plot in link:
        assert 40 in out["hovered"][plot], (plot, out["hovered"])
