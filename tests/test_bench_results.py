"""cquant bench's results file: what is refused (untouched, with the argument named), what resumes."""

import json

import pytest

from cquant.bench.results import ResultStore, read_results


def _record(key, status="ok"):
    return dict(key=key, label=key, model="flux-dev", mode="step", dtype="bf16", batch=1, status=status,
                settings={}, latency_ms={"p50": 1.0, "p90": 1.0, "p99": 1.0})


def _write(path, *lines, end="\n"):
    path.write_text("\n".join(lines) + end)
    return str(path)


def test_a_directory_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        read_results(str(tmp_path))
    with pytest.raises(ValueError, match="is a directory"):
        ResultStore(str(tmp_path))


def test_a_record_without_the_fields_the_report_needs_is_refused(tmp_path):
    path = _write(tmp_path / "r.jsonl", json.dumps({"key": "a", "status": "ok"}))
    with pytest.raises(ValueError, match="line 1: not a cquant bench record"):
        read_results(path)


def test_a_binary_file_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError, match="not text"):
        read_results(str(path))


@pytest.mark.parametrize("tail", ["my notes, no newline", '{"key": "x"'])
def test_resuming_a_foreign_file_leaves_it_untouched(tmp_path, tail):
    path = _write(tmp_path / "notes.txt", "first line of something else", tail, end="")
    before = open(path, "rb").read()
    with pytest.raises(ValueError, match="notes.txt, line 1"):
        ResultStore(path)
    assert open(path, "rb").read() == before
    one = _write(tmp_path / "one.txt", "hello", end="")  # one foreign line without its newline
    with pytest.raises(ValueError, match="one.txt, line 1"):
        ResultStore(one)
    assert open(one).read() == "hello"


def test_resuming_cuts_only_a_record_cut_short(tmp_path):
    whole = json.dumps(_record("a"))
    path = _write(tmp_path / "r.jsonl", whole, json.dumps(_record("b"))[:20], end="")
    store = ResultStore(path)
    assert set(store.records) == {"a"} and open(path).read() == whole + "\n"
    store.append(_record("c"))
    assert [r["key"] for r in read_results(path)] == ["a", "c"]
    only = _write(tmp_path / "only.jsonl", whole[:15], end="")  # the very first write cut short
    assert ResultStore(only).records == {} and open(only).read() == ""
    unended = _write(tmp_path / "u.jsonl", whole, end="")  # a whole record missing only its newline
    ResultStore(unended).append(_record("b"))
    assert [r["key"] for r in read_results(unended)] == ["a", "b"]


def test_a_path_that_cannot_be_written_fails_before_any_cell(tmp_path):
    blocker = _write(tmp_path / "file", "x")
    with pytest.raises(ValueError, match="cannot be written"):
        ResultStore(blocker + "/r.jsonl")


@pytest.mark.parametrize("argv,option,message", [
    (["--report", "{dir}"], "--report", "is a directory"),
    (["--report", "{foreign}"], "--report", "not a cquant bench record"),
    (["--quick", "--out", "{dir}"], "--out", "is a directory"),
    (["--quick", "--out", "{foreign}"], "--out", "not a cquant bench record"),
    (["--quick", "--out", "{file}/r.jsonl"], "--out", "cannot be written"),
    (["--quick", "--out-dir", "{file}"], "--out-dir", "not a directory"),
    (["--report", "{results}", "--out-dir", "{file}/rep"], "--out-dir", "cannot be made"),
])
def test_cli_names_the_bad_path(tmp_path, capsys, argv, option, message):
    pytest.importorskip("diffusers")
    from cquant.bench import runner
    from cquant.bench.cli import main

    paths = dict(dir=str(tmp_path), foreign=_write(tmp_path / "f.jsonl", json.dumps({"key": "a", "status": "ok"})),
                 file=_write(tmp_path / "file", "x"), results=_write(tmp_path / "r.jsonl", json.dumps(_record("a"))))
    ran = []
    runner_run_grid = runner.run_grid
    try:
        runner.run_grid = lambda *a, **k: ran.append(1) or []
        with pytest.raises(SystemExit) as e:
            main([a.format(**paths) for a in argv])
    finally:
        runner.run_grid = runner_run_grid
    err = capsys.readouterr().err
    assert e.value.code == 2 and option in err and message in err and not ran


@pytest.mark.parametrize("kw,message", [
    (dict(repeats=0), "repeats must be an int >= 1, got 0"), (dict(iters=-1), "iters must be an int >= 1"),
    (dict(warmup=-1), "warmup must be an int >= 0, got -1"), (dict(repeats="3"), "repeats must be an int >= 1, got '3'"),
    (dict(height=17), "height must be a multiple of 16, got 17"), (dict(steps=0), "steps must be an int >= 1"),
    # torch.device("tpu") throws through torch's C++ (aborts the ASan run)
    pytest.param(dict(device="tpu"), "device: ", marks=pytest.mark.raises_in_torch_op),
])
def test_run_grid_names_a_bad_setting_before_any_cell(tmp_path, kw, message):
    pytest.importorskip("diffusers")
    from cquant.bench import grid as G
    from cquant.bench.runner import run_grid

    out = tmp_path / "r.jsonl"
    grid = G.make_grid([dict(model="flux-dev", scheme="none,int8wo")])
    with pytest.raises(ValueError, match=message):
        run_grid(grid, **{**dict(device="cpu", tiny=True, progress=False, out=str(out)), **kw})
    assert not out.exists()  # no cell ran, no error record was written


def test_write_report_of_records_names_a_bad_one(tmp_path):
    from cquant.bench.report import write_report

    with pytest.raises(TypeError, match="results: expected a JSONL path or a list of records, got int"):
        write_report(5, str(tmp_path))
    with pytest.raises(ValueError, match=r"results\[1\]: not a cquant bench record"):
        write_report([_record("a"), {"a": 1}], str(tmp_path))


def test_ctrl_c_ends_the_command_with_a_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    pytest.importorskip("diffusers")
    from cquant import __main__ as cli
    from cquant.bench import runner

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_grid", interrupted)
    assert cli.main(["bench", "--quick", "--out", str(tmp_path / "r.jsonl")]) == 130
    assert "cquant bench: interrupted (rerun with the same --out to resume)" in capsys.readouterr().err


@pytest.mark.parametrize("extra,option", [(["--out", "r.jsonl"], "--out"), (["--steps", "4"], "--steps"),
                                          (["--tiny"], "--tiny"), (["--no-interleave"], "--no-interleave")])
def test_cli_text_encoder_mode_refuses_options_it_would_ignore(capsys, extra, option):
    pytest.importorskip("diffusers")
    from cquant.bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--mode", "text-encoder", "--device", "cpu", "--list", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{option} does not apply to --mode text-encoder" in err
