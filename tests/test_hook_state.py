"""Checkpointing the DDP hook's state (its error buffers are training state): pickling, state
dicts, exact resume.

A reference run trains STEPS steps and saves model, optimizer and hook state after some of
them; fresh processes build a new DDP (whose first iteration uses DDP's initial buckets, not
the rebuilt ones the reference was using), restore, finish the run and must end bit-identical.
The gloo scenarios share four spawned worlds (tests/gloo_cases.py, fixture ``worlds``): the
references and the bad loads of each world size in one, the resumes in fresh processes.
"""

from __future__ import annotations

import logging
import os
import pickle
import re

import pytest
import torch
from gloo_cases import Case, run_cases

from cokit.compress.hooks import DCTTopKState, dct_topk_hook

STEPS = 5
SAVE_AT = (1, 3)  # after step 1: DDP has not rebuilt its buckets yet; after step 3: it has
SETTINGS = {"topk": 8, "chunk": 16}
# compressed under SETTINGS in worlds 2 and 3 (c.bias, one value, is all-reduced dense)
COMPRESSED = ["a.bias", "a.weight", "b.bias", "b.weight", "c.weight", "norm.bias", "norm.weight"]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.b = torch.nn.Linear(64, 32)
        self.c = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.norm(self.a(x))))))


def _ddp(model_state=None):
    """A new DDP model: one bucket on its first iteration, two once DDP rebuilds them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    module = _Net()
    if model_state is not None:
        module.load_state_dict(model_state)
    return DDP(module, bucket_cap_mb=0.004)


def _optimizer(net):
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def _step(net, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 24, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2]
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()


def _params(net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _reference(rank: int, world: int, warmup: int, folder: str):
    """Train STEPS steps; after each of SAVE_AT save a state-dict and a pickled checkpoint."""
    os.environ["TRITON_INTERPRET"] = "0"
    net = _ddp()
    opt = _optimizer(net)
    state = DCTTopKState(warmup_steps=warmup, **SETTINGS)
    net.register_comm_hook(state.attach(net), dct_topk_hook)
    saved = {}
    for step in range(STEPS):
        _step(net, opt, rank, step)
        if step + 1 in SAVE_AT:
            at = step + 1
            common = {"model": net.module.state_dict(), "opt": opt.state_dict()}
            torch.save({**common, "hook": state.state_dict()}, f"{folder}/sd{at}.rank{rank}.pt")
            torch.save({**common, "hook": state}, f"{folder}/pickle{at}.rank{rank}.pt")
            saved[at] = {"buckets": len(state._layouts), "buffers": len(state.state_dict()["error_buffers"])}
    return _params(net), saved, state.state_dict()


def _resume(rank: int, world: int, warmup: int, folder: str):
    """For each checkpoint and way of restoring (and a fresh hook state as the control): a new
    DDP model, restored, trained to STEPS."""
    os.environ["TRITON_INTERPRET"] = "0"
    out = {}
    for at in SAVE_AT:
        for how in ("state_dict", "pickle", "fresh"):
            name = "pickle" if how == "pickle" else "sd"
            ck = torch.load(f"{folder}/{name}{at}.rank{rank}.pt", weights_only=how != "pickle")
            net = _ddp(ck["model"])
            opt = _optimizer(net)
            opt.load_state_dict(ck["opt"])
            if how == "state_dict":
                state = DCTTopKState(warmup_steps=warmup, **SETTINGS).attach(net)
                state.load_state_dict(ck["hook"])
            elif how == "pickle":
                state = ck["hook"].attach(net)
            else:  # the same counters, but error buffers starting at zero
                state = DCTTopKState(warmup_steps=warmup, iteration=ck["hook"]["iteration"], **SETTINGS)
                state.attach(net)
            net.register_comm_hook(state, dct_topk_hook)
            for step in range(at, STEPS):
                _step(net, opt, rank, step)
            out[at, how] = (_params(net), state.state_dict())
    return out


def _same_state(a: dict, b: dict) -> bool:
    """Two hook state dicts hold the same counters and (bitwise) buffers. Of the comm totals only
    steps and dense bytes: the sent bytes include one set of non-finite flags per DDP bucket, and
    a resumed run's first iteration has DDP's initial buckets."""
    same = {k: a[k] == b[k] for k in a if k not in ("error_buffers", "comm_stats")}
    stats = ["steps", "total_dense_bytes"]
    buffers = a["error_buffers"].keys() == b["error_buffers"].keys() and all(
        torch.equal(t, b["error_buffers"][n]) for n, t in a["error_buffers"].items()
    )
    return all(same.values()) and all(a["comm_stats"][k] == b["comm_stats"][k] for k in stats) and buffers


RESUMES = {2: (0, 2), 3: (0,)}  # world size: warmup steps of the resume scenarios


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, dict[str, list]]:
    """Per world size: the references (and, at world 2, the bad loads and the pickled group;
    at world 3, loading world 2's files) in one world, then every resume in fresh processes."""
    bad = str(tmp_path_factory.mktemp("bad"))
    out = {}
    for world, warmups in RESUMES.items():
        folders = {w: str(tmp_path_factory.mktemp(f"resume{world}-{w}")) for w in warmups}
        cases = [Case(f"reference {w}", _reference, (w, folders[w])) for w in warmups]
        if world == 2:
            cases += [Case("bad loads", _bad_loads, (bad,)), Case("group note", _group_note)]
        else:  # the files world 2 wrote in "bad loads"
            cases.append(Case("other world", _other_world, (bad,)))
        out[world] = run_cases(world, cases)
        out[world].update(run_cases(world, [Case(f"resume {w}", _resume, (w, folders[w])) for w in warmups]))
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world, warmup", [(2, 0), (3, 0), (2, 2)])
def test_a_restored_hook_state_resumes_bit_identically(worlds, world, warmup):
    reference, resumed = worlds[world][f"reference {warmup}"], worlds[world][f"resume {warmup}"]
    for rank, ((final, saved, final_state), runs) in enumerate(zip(reference, resumed, strict=True)):
        if warmup == 0:  # the checkpoints were taken on DDP's initial buckets and on its rebuilt ones
            assert [saved[at]["buckets"] for at in SAVE_AT] == [1, 2]
        for at in SAVE_AT:
            for how in ("state_dict", "pickle"):
                params, state = runs[at, how]
                assert all(torch.equal(a, b) for a, b in zip(params, final, strict=True)), (rank, at, how)
                assert _same_state(state, final_state), (rank, at, how)
            if saved[at]["buffers"]:  # control: without the error buffers the run goes elsewhere
                assert saved[at]["buffers"] == len(COMPRESSED)
                assert not all(torch.equal(a, b) for a, b in zip(runs[at, "fresh"][0], final, strict=True))
            else:
                assert at <= warmup


def _clone(sd: dict) -> dict:
    return {**sd, "error_buffers": {n: t.clone() for n, t in sd["error_buffers"].items()}}


def _with(sd: dict, **changes) -> dict:
    return {**_clone(sd), **changes}


def _buffers(sd: dict, **changes) -> dict:
    out = {**_clone(sd)["error_buffers"], **changes}
    return _with(sd, error_buffers={n: t for n, t in out.items() if t is not None})


def _bad_loads(rank: int, world: int, folder: str):
    """Every bad load raises and leaves the state as it was; unattached states refuse to save."""
    import torch.distributed as dist

    os.environ["TRITON_INTERPRET"] = "0"
    net = _ddp()
    opt = _optimizer(net)
    state = DCTTopKState(**SETTINGS)
    net.register_comm_hook(state.attach(net), dct_topk_hook)
    for step in range(2):
        _step(net, opt, rank, step)
    sd = state.state_dict()
    torch.save(sd, f"{folder}/sd.rank{rank}.pt")
    torch.save(state, f"{folder}/pickle.rank{rank}.pt")
    before = _clone(sd)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, sd)
    other = everyone[1 - rank]
    a = sd["error_buffers"]["a.weight"]
    nan = a.clone()
    nan[3, 4] = float("nan")
    cases = {
        "other rank": other,
        "other settings": _with(sd, settings={**sd["settings"], "topk": 4, "decay": 0.5}),
        "wrong shape": _buffers(sd, **{"a.weight": torch.zeros(3, 3)}),
        "nan buffer": _buffers(sd, **{"a.weight": nan}),
        "float64 buffer": _buffers(sd, **{"a.weight": a.double()}),
        "unknown name": _buffers(sd, **{"nope.weight": a.clone()}),
        "missing buffer": _buffers(sd, **{"b.weight": None}),
        "dense parameter": _buffers(sd, **{"c.bias": torch.zeros(1)}),
        "negative iteration": _with(sd, iteration=-1),
        "bad comm_stats": _with(sd, comm_stats={**sd["comm_stats"], "steps": "2"}),
        "not a state dict": {"format": "something else"},
        "extra key": _with(sd, extra=1),
    }
    errors = {}
    for what, bad in cases.items():
        try:
            state.load_state_dict(bad)
        except (ValueError, TypeError, RuntimeError) as exc:
            errors[what] = f"{type(exc).__name__}: {exc}"
        assert _same_state(state.state_dict(), before), what
    for what, fresh in {
        "other settings (state)": DCTTopKState(topk=4, chunk=16).attach(net),
        "not attached": DCTTopKState(**SETTINGS),
    }.items():
        try:
            fresh.load_state_dict(_clone(sd))
        except (ValueError, TypeError, RuntimeError) as exc:
            errors[what] = f"{type(exc).__name__}: {exc}"
        assert fresh.iteration == 0 and not fresh._errors, what
    # another rank's pickled state: refused on attach, and by the hook if never attached
    theirs = torch.load(f"{folder}/pickle.rank{1 - rank}.pt", weights_only=False)
    try:
        theirs.attach(net)
    except ValueError as exc:
        errors["other rank (pickle)"] = str(exc)
    # an unpickled state with buffers, registered without attach: backward() refuses
    mine = pickle.loads(pickle.dumps(state))
    fresh_net = _ddp()
    fresh_net.register_comm_hook(mine, dct_topk_hook)
    try:
        _step(fresh_net, _optimizer(fresh_net), rank, 0)
    except RuntimeError as exc:
        errors["unpickled, not attached"] = str(exc)
    # a state never attached cannot name its buffers; attach() names them afterwards
    plain_net = _ddp()
    plain = DCTTopKState(**SETTINGS)
    plain_net.register_comm_hook(plain, dct_topk_hook)
    _step(plain_net, _optimizer(plain_net), rank, 0)
    for what, save in {"state_dict": plain.state_dict, "pickle": lambda: pickle.dumps(plain)}.items():
        try:
            save()
        except RuntimeError as exc:
            errors[f"unattached {what}"] = str(exc)
    try:
        plain.attach(net)  # buffers of plain_net's parameters: not net's
    except RuntimeError as exc:
        errors["attach to another model"] = str(exc)
    named = sorted(plain.attach(plain_net).state_dict()["error_buffers"])
    return errors, named


def _other_world(rank: int, world: int, folder: str):
    os.environ["TRITON_INTERPRET"] = "0"
    net = _ddp()
    state = DCTTopKState(**SETTINGS).attach(net)
    errors = []
    for load in (
        lambda: state.load_state_dict(torch.load(f"{folder}/sd.rank0.pt", weights_only=True)),
        lambda: torch.load(f"{folder}/pickle.rank0.pt", weights_only=False).attach(net),
    ):
        try:
            load()
        except ValueError as exc:
            errors.append(str(exc))
    return errors, state.iteration, dict(state._errors)


@pytest.mark.distributed
@pytest.mark.slow
def test_bad_loads_raise_clear_errors_and_change_nothing(worlds):
    for rank, (errors, named) in enumerate(worlds[2]["bad loads"]):
        other = 1 - rank
        expect = {
            "other rank": rf"ValueError: .*records of rank\(s\) \[{other}\], this is rank {rank}: every rank must load the state it saved",
            "other rank (pickle)": rf"rank\(s\) \[{other}\], this is rank {rank}",
            "other settings": r"setting 'decay' was 0.5, is 1.0 now; setting 'topk' was 4, is 8 now.*Build it with the settings",
            "other settings (state)": r"setting 'topk' was 8, is 4 now",
            "wrong shape": r"'a.weight' has shape \(3, 3\), expected \(64, 24\)",
            "nan buffer": "ValueError: .*'a.weight' is not finite",
            "float64 buffer": "TypeError: .*'a.weight' must be a torch.float32 tensor, got torch.float64",
            "unknown name": "error buffer for 'nope.weight', but the model has no trainable parameter",
            "missing buffer": r"no error buffer for the compressed parameters \['b.weight'\]",
            "dense parameter": "error buffer for 'c.bias', which these settings all-reduce dense",
            "negative iteration": "the saved iteration is -1, not a count; the file is damaged",
            "bad comm_stats": r"the saved comm_stats do not load \(steps is '2', not a number >= 0\)",
            "not a state dict": "this cokit reads DCTTopKState format",
            "extra key": r"the state has the keys .*, DCTTopKState.state_dict\(\) saves",
            "not attached": r"RuntimeError: .*call state.attach\(ddp_model\) before load_state_dict",
            "unpickled, not attached": r"unpickled with the error buffers of 7 parameters: call state.attach",
            "unattached state_dict": r"does not know their names: call state.attach\(ddp_model\)",
            "unattached pickle": r"DCTTopKState pickling: .*does not know their names",
            "attach to another model": "error buffers of 7 parameters that are not in this model",
        }
        assert errors.keys() == expect.keys(), sorted(set(expect) ^ set(errors))
        for what, pattern in expect.items():
            assert re.search(pattern, errors[what]), (what, errors[what])
        assert named == COMPRESSED
    for errors, iteration, buffers in worlds[3]["other world"]:
        assert len(errors) == 2 and iteration == 0 and not buffers
        for message in errors:
            assert "saved at world size 2, this run has world size 3" in message


def _group_note(rank: int, world: int):
    import torch.distributed as dist

    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(f"{record.levelname} {record.getMessage()}")

    logger = logging.getLogger("cokit.compress.hooks")
    logger.addHandler(_Keep())
    logger.setLevel(logging.INFO)
    group = dist.new_group(list(range(world)))
    back = pickle.loads(pickle.dumps(DCTTopKState(process_group=group, iteration=3)))
    return records, back.process_group is None, back.iteration


@pytest.mark.distributed
def test_pickling_drops_a_process_group_with_a_warning_and_loads_on_the_default_one(worlds):
    for records, default, iteration in worlds[2]["group note"]:
        assert default and iteration == 3
        assert any(
            r.startswith("WARNING NOTE: DCTTopKState's process group is not picklable") for r in records
        )
        assert any(
            r.startswith("WARNING NOTE: DCTTopKState loaded on the default process group") for r in records
        )
        assert any("state.process_group = <your group>" in r for r in records)


def test_an_unused_state_pickles_with_its_settings_and_counters(caplog):
    state = DCTTopKState(topk=4, chunk=8, payload="sign", value_dtype=torch.float16, decay=0.9, iteration=7)
    state.skipped_steps = 2
    state.comm_stats.record(100, 100, 400)
    with caplog.at_level(logging.INFO, logger="cokit.compress.hooks"):
        back = pickle.loads(pickle.dumps(state))
    assert back == state  # the dataclass fields: settings, counters, comm_stats totals
    assert back.comm_stats.total_sent_bytes == 100 and back.comm_stats.steps == 1
    assert back._restored is None and back._lock is not state._lock
    assert "left out of the pickle" in caplog.text and "default process group" in caplog.text


def test_state_dict_needs_torch_distributed():
    with pytest.raises(RuntimeError, match=r"state_dict needs torch.distributed initialized"):
        DCTTopKState().state_dict()
    with pytest.raises(TypeError, match="attach: model must be the DDP model"):
        DCTTopKState().attach("model")
