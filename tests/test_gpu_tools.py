"""The GPU-machine tools' own checks, which run without a GPU: tools/stage_vllm_gpu.py (what it stages for
vLLM on a machine without network) and benchmarks/serving_gpu.py (its options and its rows)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def stage(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    sys.modules.pop("stage_vllm_gpu", None)
    import stage_vllm_gpu

    return stage_vllm_gpu


def fake_wheel(
    folder: Path, name: str, version: str, requires: list[str], members: dict | None = None
) -> Path:
    """A wheel file holding a METADATA with ``requires`` as Requires-Dist lines (and ``members``)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        for member, data in (members or {}).items():
            z.writestr(member, data)
    return path


def test_the_closure_follows_extras_and_markers_and_skips_what_the_machine_has(stage, tmp_path, monkeypatch):
    """Requires-Dist walked breadth first for Python 3.12 on Linux x86-64: an extra asked for later adds its
    requirements, a marker for another platform or Python drops one, the machine's packages, the skipped
    GPU kernels and torch are left out with the reason, and a pinned version wins over the requirement's."""
    index = tmp_path / "index"
    index.mkdir()
    wheels = {
        "app": fake_wheel(index, "app", "1.0", ["web>=1", "torch==2.11.0", "winonly; sys_platform == 'win32'",
                                                "old; python_version < '3.10'", "numpy", "tilelang"]),
        "web": fake_wheel(index, "web", "1.5", ["h11", "uvicorn; extra == 'standard'"]),
        "lib": fake_wheel(index, "lib", "2.0", ["web[standard]"]),
        "uvicorn": fake_wheel(index, "uvicorn", "0.55", []),
        "h11": fake_wheel(index, "h11", "0.16", []),
        "xgrammar": fake_wheel(index, "xgrammar", "0.2.9", []),
    }  # fmt: skip
    asked = []

    def download(spec, dest):
        asked.append(spec)
        name = stage.Requirement(spec).name
        return wheels[name]

    monkeypatch.setattr(stage, "download", download)
    got, left = stage.closure(["app", "lib", "xgrammar>=0.1"], {"numpy", "h11"}, tmp_path / "d")
    assert sorted(got) == ["app", "lib", "uvicorn", "web", "xgrammar"]
    assert "xgrammar==0.2.9" in asked and "web>=1" in asked  # the pin; the first requirement's version
    assert left["numpy"] == left["h11"] == "on the GPU machine"
    assert "torch kept" in left["torch"] and "torch kept" in left["tilelang"]
    assert "winonly" not in left and "old" not in left and "winonly" not in got


def test_the_vllm_wheel_loses_the_trimmed_members_and_is_stored_uncompressed(stage, tmp_path):
    src = fake_wheel(
        tmp_path,
        "vllm",
        "0.26.0",
        [],
        {"vllm/__init__.py": "x = 1\n" * 100, stage.TRIM[0]: b"\0" * 5000, stage.TRIM[2]: b"\1" * 300},
    )
    out = tmp_path / "out.whl"
    info = stage.trim_vllm(src, out)
    assert info["removed_uncompressed_bytes"] == 5300
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        assert stage.TRIM[0] not in names and stage.TRIM[2] not in names and "vllm/__init__.py" in names
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
        assert z.read("vllm/__init__.py") == b"x = 1\n" * 100


def test_read_have_takes_pip_freeze_lines_and_bare_names(stage, tmp_path):
    f = tmp_path / "have.txt"
    f.write_text("# comment\nTorch==2.11.0\npydantic_core @ file:///x\n\ntyping-extensions\n")
    assert stage.read_have(f) == {"torch", "pydantic-core", "typing-extensions"}


def run_stage(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "stage_vllm_gpu.py"), *argv], cwd=cwd,
                          capture_output=True, text=True)  # fmt: skip


def test_stage_refuses_bad_options_before_downloading(tmp_path):
    res = run_stage("--out", str(tmp_path / "o"), "--have", str(tmp_path / "none.txt"))
    assert res.returncode and "none.txt: not a file" in res.stderr
    (tmp_path / "cols.txt").write_text("Package    Version\n---------- -------\nnumpy      2.5.2\n")
    res = run_stage("--out", str(tmp_path / "o"), "--have", str(tmp_path / "cols.txt"))
    assert res.returncode and "line 1: 'Package    Version' is not 'name==version'" in res.stderr
    (tmp_path / "empty.txt").write_text("# nothing\n")
    res = run_stage("--out", str(tmp_path / "o"), "--have", str(tmp_path / "empty.txt"))
    assert res.returncode and "names no package" in res.stderr
    (tmp_path / "afile").write_text("")
    res = run_stage("--out", str(tmp_path / "afile"))
    assert res.returncode and "exists and is not a folder" in res.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    res = run_stage("--out", str(tmp_path / "mine"), "--overwrite")
    assert res.returncode and "holds other files" in res.stderr and (tmp_path / "mine" / "notes.txt").exists()
    res = run_stage("--out", str(tmp_path / "o"), "--part-mb", "70")
    assert res.returncode and "--part-mb 70.0: give 5 to 64" in res.stderr
    (tmp_path / "o" / "p1").mkdir(parents=True)
    (tmp_path / "o" / "p1" / "manifest.json").write_text("{}")
    res = run_stage("--out", str(tmp_path / "o"))
    assert res.returncode and "holds parts of an earlier staging; --overwrite replaces them" in res.stderr


def staging(root: Path, payload: bytes, parts: int = 2) -> list[Path]:
    """A staging as stage_vllm_gpu.py lays it out: ``payload`` in a wheels/ tar.xz cut into ``parts``."""
    import hashlib
    import lzma
    import tarfile

    src = root / "src"
    src.mkdir(parents=True)
    (src / "x-1.0-py3-none-any.whl").write_bytes(payload)
    with tarfile.open(root / "a.tar", "w") as t:
        t.add(src / "x-1.0-py3-none-any.whl", arcname="./x-1.0-py3-none-any.whl")
    blob = lzma.compress((root / "a.tar").read_bytes())
    size = len(blob) // parts + 1
    chunks = [blob[i : i + size] for i in range(0, len(blob), size)]
    manifest = {
        "archive_sha256": hashlib.sha256(blob).hexdigest(),
        "parts": [
            {"name": f"p{i + 1}", "sha256": hashlib.sha256(c).hexdigest()} for i, c in enumerate(chunks)
        ],
        "wheels": ["x-1.0-py3-none-any.whl"],
    }
    out = []
    for i, c in enumerate(chunks):
        d = root / f"p{i + 1}"
        d.mkdir()
        (d / "stage.part").write_bytes(c)
        (d / "manifest.json").write_text(json.dumps(manifest))
        out.append(d)
    return out


def receive(part: Path, stage_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "stage_vllm_receive.py"), str(part), str(stage_dir)],
                          capture_output=True, text=True)  # fmt: skip


def test_received_parts_are_named_by_their_hash_and_another_stagings_part_starts_over(tmp_path):
    """A part is placed by its SHA-256 in the manifest (its folder's name does not matter), a damaged one
    is refused when it arrives, a part of another staging drops the earlier one's, and the last part unpacks
    the wheels."""
    import os

    st = tmp_path / "stage"
    a = staging(tmp_path / "a", os.urandom(3000))
    b = staging(tmp_path / "b", os.urandom(3000))
    renamed = a[1].rename(tmp_path / "a" / "second-part")
    assert receive(renamed, st).stdout.splitlines()[-1] == "waiting" and (st / "parts" / "p2.part").exists()
    bad = tmp_path / "bad"
    shutil.copytree(a[0], bad)
    (bad / "stage.part").write_bytes(b"\0" + (bad / "stage.part").read_bytes()[1:])
    res = receive(bad, st)
    assert res.returncode == 2 and "matches no part of its manifest" in res.stderr
    res = receive(b[0], st)  # another staging: a's part is dropped
    assert "another staging" in res.stdout and sorted(p.name for p in (st / "parts").iterdir()) == ["p1.part"]
    res = receive(b[1], st)
    assert res.stdout.splitlines()[-1] == "complete"
    assert (st / "wheels" / "x-1.0-py3-none-any.whl").read_bytes() == (
        tmp_path / "b" / "src" / "x-1.0-py3-none-any.whl"
    ).read_bytes()
    (a[0] / "manifest.json").write_text("{")
    res = receive(a[0], st)
    assert res.returncode == 2 and "not a manifest stage_vllm_gpu.py wrote" in res.stderr


def test_the_device_script_names_a_missing_part_folder_and_an_unknown_command(tmp_path):
    sh = REPO / "tools" / "stage_vllm_gpu.sh"
    assert subprocess.run(["bash", "-n", str(sh)]).returncode == 0
    res = subprocess.run(["bash", str(sh), "receive", str(tmp_path / "p9")], capture_output=True, text=True)
    assert res.returncode == 2 and "no stage.part and manifest.json there" in res.stderr
    res = subprocess.run(["bash", str(sh), "nope"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown command nope" in res.stderr


def test_the_serving_device_script_shows_its_usage_and_refuses_a_shared_folder_without_data(tmp_path):
    sh = REPO / "benchmarks" / "serving_gpu_device.sh"
    assert subprocess.run(["bash", "-n", str(sh)]).returncode == 0
    res = subprocess.run(["bash", str(sh)], capture_output=True, text=True)
    assert res.returncode == 0 and "start SHARED [SERVING_GPU OPTIONS]" in res.stdout
    res = subprocess.run(["bash", str(sh), "start", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and f"{tmp_path} has no data/ folder" in res.stderr
    res = subprocess.run(["bash", str(sh), "nope"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown command nope" in res.stderr
    res = subprocess.run(
        ["bash", str(sh), "scaling", str(tmp_path)], capture_output=True, text=True, cwd=REPO
    )
    assert res.returncode == 2 and f"{tmp_path} has no data/prompts/humaneval.jsonl.gz" in res.stderr
    res = subprocess.run(["bash", str(sh), "wait", "1x"], capture_output=True, text=True)
    assert res.returncode == 2 and "SECONDS must be a whole number of seconds, got '1x'" in res.stderr


def test_wait_until_a_record_exists_returns_while_the_run_goes_on(tmp_path):
    """``wait SECONDS UNTIL``: a running run's wait ends as soon as UNTIL (a path under the work folder)
    exists, not at SECONDS, and says the run goes on; a path outside the work folder is refused."""
    import time

    sh, work, out = REPO / "benchmarks" / "serving_gpu_device.sh", tmp_path / "sg", tmp_path / "out"
    env = {**os.environ, "SG_WORK": str(work), "OUT": str(out)}
    for bad in ("../etc", "/etc/passwd", "online/../../x"):
        res = subprocess.run(["bash", str(sh), "wait", "5", bad], capture_output=True, text=True, env=env)
        assert res.returncode == 2 and "UNTIL is a path under the work folder" in res.stderr, bad
    (work / "online").mkdir(parents=True)
    run = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "sg.pid").write_text(f"{run.pid}\n")
        (work / "online" / "online.json").write_text("")  # begun, not written: no early end
        res = subprocess.run(
            ["bash", str(sh), "wait", "2", "online/online.json"], capture_output=True, text=True, env=env
        )
        assert "== still running" in res.stdout
        (work / "online" / "online.json").write_text("{}\n")
        t = time.time()
        res = subprocess.run(
            ["bash", str(sh), "wait", "40", "online/online.json"], capture_output=True, text=True, env=env
        )
        took = time.time() - t
        assert (
            res.returncode == 0 and "== online/online.json is there" in res.stdout and "goes on" in res.stdout
        )
        assert took < 10 and run.poll() is None
        (work / "online" / "online.json").unlink()  # absent: the wait runs to SECONDS while the run goes on
        t = time.time()
        res = subprocess.run(
            ["bash", str(sh), "wait", "3", "online/online.json"], capture_output=True, text=True, env=env
        )
        # the script counts the clock's whole seconds: a wait of 3 lasts more than 2
        assert "== still running" in res.stdout and time.time() - t >= 2
    finally:
        run.kill()


def test_keep_brings_back_one_trained_run_in_parts_without_its_checkpoints_and_start_reads_it_back(tmp_path):
    """``keep NAME``: the drafter's run in 15 MiB parts holding its data stages and served folder, none of its
    checkpoints or other export layouts; the parts put together give the run back; a drafter not trained
    (or none named) is refused by name."""
    sh, work, out = REPO / "benchmarks" / "serving_gpu_device.sh", tmp_path / "sg", tmp_path / "out"
    env = {**os.environ, "SG_WORK": str(work), "OUT": str(out)}
    res = subprocess.run(["bash", str(sh), "keep"], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "keep: name the drafter" in res.stderr
    run = work / "eagle3.1" / "run"
    random = __import__("random").Random(0)
    files = {
        "tokens.safetensors": b"t" * 10,
        "drafter/model.safetensors": random.randbytes(20 * 2**20),  # 20 MiB that gzip cannot shrink
        "drafter-speculators/model.safetensors": b"s" * 10,
        "checkpoints/best.safetensors": b"c" * 10,
    }
    for f, data in files.items():
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_bytes(data)
    (work / "eagle3.1" / "trained.json").write_text("{}\n")
    res = subprocess.run(["bash", str(sh), "keep", "dflash"], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "no trained drafter dflash" in res.stderr
    res = subprocess.run(["bash", str(sh), "keep", "eagle3.1"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    parts = sorted(p.name for p in out.iterdir())
    assert parts == ["run-eagle3.1.tgz.part-00", "run-eagle3.1.tgz.part-01"]
    assert all((out / p).stat().st_size <= 15 * 2**20 for p in parts)
    back = tmp_path / "back"
    back.mkdir()
    whole = b"".join((out / p).read_bytes() for p in parts)
    subprocess.run(["tar", "-xz", "-C", str(back)], input=whole, check=True)
    got = back / "sg" / "eagle3.1"
    assert (got / "trained.json").exists() and (got / "run" / "tokens.safetensors").exists()
    assert (got / "run" / "drafter" / "model.safetensors").read_bytes() == files["drafter/model.safetensors"]
    assert not (got / "run" / "checkpoints").exists() and not (got / "run" / "drafter-speculators").exists()
    # `readback` (what start does first) from the parts carried in .gpudata/runs, into an empty work folder
    here, fresh = tmp_path / "repo", tmp_path / "fresh" / "sg"
    (here / ".gpudata" / "runs").mkdir(parents=True)
    env2 = {**env, "SG_WORK": str(fresh)}
    shutil.copy(out / parts[0], here / ".gpudata" / "runs" / parts[0])  # one part missing: nothing read back
    res = subprocess.run(["bash", str(sh), "readback"], capture_output=True, text=True, env=env2, cwd=here)
    assert res.returncode == 1 and "do not make one whole archive" in res.stderr
    assert not (fresh / "eagle3.1").exists()
    shutil.copy(out / parts[1], here / ".gpudata" / "runs" / parts[1])
    res = subprocess.run(["bash", str(sh), "readback"], capture_output=True, text=True, env=env2, cwd=here)
    assert res.returncode == 0 and "eagle3.1: read back" in res.stdout, res.stderr
    assert (fresh / "eagle3.1" / "run" / "drafter" / "model.safetensors").read_bytes() == files[
        "drafter/model.safetensors"
    ]
    res = subprocess.run(["bash", str(sh), "keep", "../up"], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "is not a drafter's name" in res.stderr


@pytest.fixture()
def serving(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("serving_gpu", None)
    import serving_gpu

    return serving_gpu


def test_serving_gpu_refuses_bad_options_before_its_expected_time_line(
    serving, monkeypatch, capsys, tmp_path
):
    work = tmp_path / "work"

    def refusal(*argv: str) -> str:
        argv = [
            "serving_gpu.py",
            "--shared",
            str(Path(__file__).parents[2] / "shared"),
            "--work",
            str(work),
            *argv,
        ]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as e:
            serving.main()
        assert capsys.readouterr().out == ""
        return str(e.value.code)

    assert "K up to 7" in refusal("--ks", "3,8")
    assert "'0' is not an integer of at least 1" in refusal("--concurrency", "0,4")
    assert "'x' is not one of eagle3.1, eagle3, dflash, specforge" in refusal("--drafters", "eagle3.1,x")
    assert "specforge trains on the first drafter's data; name an eagle3kit drafter first" in refusal(
        "--drafters", "specforge,eagle3.1"
    )
    assert "3 is given twice" in refusal("--ks", "3,3")
    assert "an empty entry" in refusal("--ks", "3,,5")
    assert "give 0.05 to 0.45" in refusal("--gpu-share", "0.9")
    assert "mt_bench.jsonl is missing" in refusal("--shared", str(tmp_path))
    assert "--faults 'dflash': dflash not in --drafters 'eagle3.1': add it there" in refusal(
        "--drafters", "eagle3.1", "--faults", "dflash"
    )
    assert not work.exists()
    ns = serving.argparse.Namespace(drafters="eagle3.1", ks="3", concurrency="1", prompts=2, max_tokens=8, faults="",
                                    smoke=True, shared=Path(__file__).parents[2] / "shared", work=work)  # fmt: skip
    serving.check_args(ns)
    assert json.loads((work / "settings.json").read_text())["concurrency"] == [1]
    ns.ks, ns.drafters = "3,5", "eagle3.1,dflash"  # more K and drafters only add records
    serving.check_args(ns)
    message = refusal(
        "--drafters", "eagle3.1", "--concurrency", "1", "--prompts", "2", "--max-tokens", "9", "--smoke"
    )
    assert "max_tokens: 9 here, 8 there" in message and "prompts" not in message.split("(")[1].split(")")[0]


def test_a_row_carries_tau_both_ways_and_the_cost_model_of_concurrency_1(serving):
    """From a bench record and a diagnose report: per level the speed with and without the drafter, and
    at concurrency 1 the verify step S = TPOT × τ, the overhead S − T over the plain step T."""

    def level(c, tps, tpot, tau=None):
        return {"concurrency": c, "output_tokens_per_s": tps, "speedup": None, "ttft_ms": {"p50": 20.0},
                "tpot_ms": {"p50": tpot}, "acceptance": {"tau": tau} if tau else None}  # fmt: skip

    rec = {"servers": {"speculative": {"results": [level(1, 300.0, 4.0, 2.0), level(16, 2000.0, 5.0, 2.0)]},
                       "baseline": {"results": [level(1, 400.0, 2.5), level(16, 3000.0, 3.0)]}}}  # fmt: skip
    diag = {"engine": {"tau": 2.01}, "reference": {"tau": 2.0}, "verdict": "agree"}
    r = serving.row("eagle3.1", 3, {"diagnose": diag, "bench": rec}, {"mt_bench": 1.9})
    assert (r["tau_served"], r["tau_simulated"], r["verdict"]) == (2.01, 2.0, "agree")
    assert r["levels"]["16"]["plain_output_tokens_per_s"] == 3000.0 and r["levels"]["1"]["tau_vllm"] == 2.0
    assert r["cost"] == {**r["cost"], "target_step_ms": 2.5, "verify_step_ms": 8.0, "overhead_ms": 5.5}
    # the model gives back the measured speedup at concurrency 1: τ / (1 + O / T) = 2 / 3.2 = 0.625 = 2.5 / 4
    assert abs(2.0 / (1 + 5.5 / 2.5) - 2.5 / 4.0) < 1e-9


def test_the_online_rows_mfu_counts_matmul_weights_and_the_target_once_an_epoch_offline(serving, tmp_path):
    """serving_gpu.py --online: P counts 2-D weights but embeddings, a tied lm_head once; the offline row's
    target FLOPs are spread over its epochs (states cached), the online row's spent every epoch."""
    import serving_gpu_online as online
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(
        json.dumps({"tie_word_embeddings": True, "vocab_size": 10, "hidden_size": 4})
    )
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4), "layers.0.q.weight": torch.zeros(4, 4),
               "layers.0.norm.weight": torch.zeros(4)}, str(tmp_path / "model.safetensors"))  # fmt: skip
    assert online.matmul_params(tmp_path) == 16 + 40
    row = {"ttt_steps": 7, "epochs": 12, "tokens_per_s_steady": 1000.0, "tokens_per_s_wall": None}
    got = online.mfu({"offline": row, "online": row}, p_drafter=100, p_target=1200, rate=1e9)
    assert got["offline"]["flops_per_token"] == 6 * 100 * 7 + 2 * 1200 / 12
    assert got["online"]["flops_per_token"] == 6 * 100 * 7 + 2 * 1200
    assert got["online"]["steady"] == round((4200 + 2400) * 1000 / 1e9, 5) and got["online"]["wall"] is None
    assert online.mfu({"online": row}, 100, 1200, None)["online"]["steady"] is None


def test_each_drafter_kind_gets_its_own_planted_faults_and_a_row_says_whether_diagnose_named_it(
    serving, tmp_path
):
    """serving_gpu.py --faults: a DFlash folder (vLLM's layout, ``dflash_config``) gets DFlash's plants, any other
    EAGLE's; a row is correct only when diagnose named the planted fault (a mask token keeps its id)."""
    import serving_gpu_faults as faults

    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(
        json.dumps({"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 5}})
    )
    assert faults.faults_of(tmp_path / "e") == faults.EAGLE_FAULTS and "d2t_missing" in faults.EAGLE_FAULTS
    assert faults.faults_of(tmp_path / "d") == ("target_layer_ids_plus_1", "mask_token:0")
    hyp = [{"name": "mask_token:0", "tau": 1.24}, {"name": "block_causal", "tau": 1.3}]
    rep = {"verdict": "fault", "finding": "mask_token:0: the engine drafts with mask token 0", "hypotheses": hyp,
           "engine": {"tau": 1.2416}, "reference": {"tau": 1.5243}, "k": 3, "prompts": {"count": 20}}  # fmt: skip
    row = faults.summary("dflash", "mask_token:0", 1, rep, 103.2)
    assert (row["named"], row["correct"], row["tau_named_fault"], row["prompts"]) == (
        "mask_token:0",
        True,
        1.24,
        20,
    )
    agree = {**rep, "verdict": "agree", "finding": "engine and reference agree"}
    assert faults.summary("dflash", "mask_token:0", 0, agree, 1.0)["correct"] is False
    wrong = {**rep, "finding": "block_causal: ..."}
    assert faults.summary("dflash", "mask_token:0", 1, wrong, 1.0)["named"] == "block_causal"
    assert (
        faults.summary("dflash", "mask_token:0", 1, {**rep, "finding": "other: x"}, 1.0)["named"] == "other"
    )


def test_a_planted_copy_left_half_made_is_planted_again_and_a_whole_one_kept(serving, tmp_path):
    """serving_gpu_faults.plant: a killed run's partial copy (no config.json) never blocks the rerun, and a
    whole planted copy is reused as it is."""
    import serving_gpu_faults as faults
    from safetensors.torch import save_file

    src = tmp_path / "drafter"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps({"dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 5}})
    )
    save_file({"w": __import__("torch").zeros(2)}, str(src / "model.safetensors"))
    out = tmp_path / "planted"
    out.mkdir()  # what a killed run leaves: a folder without its config
    (out / "model.safetensors").write_bytes(b"cut")
    faults.plant(src, out, "target_layer_ids_plus_1")
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [2, 4]
    (out / "config.json").write_text(json.dumps({"dflash_config": {"target_layer_ids": [9]}}))
    assert faults.plant(src, out, "target_layer_ids_plus_1") == out  # whole: kept, not planted again
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [9]
    assert not (tmp_path / "planted.partial").exists()


def test_the_8b_shape_serving_refuses_bad_options_and_a_folder_pack_did_not_write(
    monkeypatch, capsys, tmp_path
):
    """benchmarks/serving_gpu_shape.py: every bad option refused before anything runs (no expected-time
    line, no --work made), and the device script's ``shape`` refuses a folder that is not a pack."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import serving_gpu_shape

    work = tmp_path / "work"

    def refusal(*argv: str) -> str:
        monkeypatch.setattr(
            sys, "argv", ["serving_gpu_shape.py", "--data", str(tmp_path), "--work", str(work), *argv]
        )
        with pytest.raises(SystemExit) as e:
            serving_gpu_shape.main()
        assert capsys.readouterr().out == ""
        return str(e.value.code)

    assert "--k 8: the drafter trains 7 TTT steps" in refusal("--k", "8")
    assert "'0' is not an integer of at least 1" in refusal("--concurrency", "1,0")
    assert "give 0.05 to 0.45" in refusal("--gpu-share", "0.6")
    assert "give at least 1 each" in refusal("--run-tokens", "0")
    assert f"--data {tmp_path}: no shapes/llama8b-* there" in refusal()
    assert not work.exists()
    sh = REPO / "benchmarks" / "serving_gpu_device.sh"
    res = subprocess.run(["bash", str(sh), "shape", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and f"{tmp_path} is not a folder recipe_shape.py pack wrote" in res.stderr
