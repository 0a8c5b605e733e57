"""tools/stage_vllm_gpu.py's SGLang staging (``--engine sglang``) and its receiving side, checked without
downloading anything and without a GPU: the options refused, the engine table, the wheels rewritten with
their members removed, and the device script's choice of folders."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_gpu_tools import fake_wheel  # the one writer of test wheels

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def stage(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    for name in ("stage_vllm_gpu", "stage_engines", "stage_sglang_check"):
        sys.modules.pop(name, None)
    import stage_vllm_gpu

    return stage_vllm_gpu


def run_stage(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "stage_vllm_gpu.py"), *argv], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip


def test_stage_sglang_refuses_bad_options_before_downloading(tmp_path):
    """The same refusals as vLLM's staging with ``--engine sglang``, an unknown engine, and
    ``--no-target`` for vLLM (whose check serves the staged SmolLM2)."""
    sg = ("--engine", "sglang")
    res = run_stage(*sg, "--out", str(tmp_path / "o"), "--have", str(tmp_path / "none.txt"))
    assert res.returncode and "none.txt: not a file" in res.stderr
    (tmp_path / "empty.txt").write_text("# nothing\n")
    res = run_stage(*sg, "--out", str(tmp_path / "o"), "--have", str(tmp_path / "empty.txt"))
    assert res.returncode and "names no package" in res.stderr
    (tmp_path / "afile").write_text("")
    res = run_stage(*sg, "--out", str(tmp_path / "afile"))
    assert res.returncode and "exists and is not a folder" in res.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    res = run_stage(*sg, "--out", str(tmp_path / "mine"), "--overwrite", "--no-target")
    assert res.returncode and "holds other files" in res.stderr and (tmp_path / "mine" / "notes.txt").exists()
    res = run_stage(*sg, "--out", str(tmp_path / "o"), "--part-mb", "70")
    assert res.returncode and "--part-mb 70.0: give 5 to 64" in res.stderr
    (tmp_path / "o" / "p1").mkdir(parents=True)
    (tmp_path / "o" / "p1" / "manifest.json").write_text("{}")
    res = run_stage(*sg, "--out", str(tmp_path / "o"))
    assert res.returncode and "holds parts of an earlier staging; --overwrite replaces them" in res.stderr
    res = run_stage("--engine", "tgi", "--out", str(tmp_path / "n"))
    assert res.returncode == 2 and "invalid choice: 'tgi'" in res.stderr
    res = run_stage("--out", str(tmp_path / "n"), "--no-target")
    assert res.returncode and "--no-target: vLLM's check serves the staged SmolLM2" in res.stderr
    assert not (tmp_path / "n").exists()


def test_the_engine_table_keeps_vllms_staging_and_gives_sglang_a_reason_for_each_package_left_out(stage):
    """vLLM's constants are those its staging always had (the default engine); SGLang's skipped packages and
    trimmed members each carry a reason, its folders differ from vLLM's, and its pins are its own."""
    eng = stage.ENGINES
    assert stage.ENGINES["vllm"].spec == stage.VLLM == "vllm==0.26.0" and stage.PINS["xgrammar"] == "0.2.9"
    assert tuple(eng["vllm"].trim["vllm"]) == stage.TRIM and len(stage.TRIM) == 7
    assert set(eng["vllm"].skip) == stage.SKIP and not eng["vllm"].store_all
    sg = eng["sglang"]
    assert sg.spec == "sglang==0.5.14" and sg.store_all and sg.check == "sglang-check"
    assert (sg.stage, sg.site) != (eng["vllm"].stage, eng["vllm"].site)
    assert all(len(why) > 20 for why in sg.skip.values())
    assert all(len(why) > 20 for members in sg.trim.values() for why in members.values())
    assert "sgl_kernel/flash_ops.abi3.so" in sg.trim["sglang-kernel"] and "sglang-kernel" not in sg.skip
    assert {"torch", "flashinfer-cubin", "torchcodec"} <= set(sg.skip) and "transformers" not in sg.skip
    assert set(sg.over_image) == {"transformers", "tokenizers"} and sg.pins == {"tokenizers": "0.22.2"}
    assert not eng["vllm"].over_image


def test_sglang_wheels_lose_their_trimmed_members_and_every_wheel_is_stored_uncompressed(stage, tmp_path):
    """``rewrite_wheels``: the engine's members removed (and named with their reason), a member the wheel
    lacks reported, an untrimmed wheel stored uncompressed too (``store_all``), the engine's own wheel moved
    into the wheels folder."""
    (tmp_path / "dl").mkdir()
    out = tmp_path / "wheels"
    out.mkdir()
    fa3, sm100 = "sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so"
    kernel = fake_wheel(
        out, "sglang_kernel", "0.4.4", [], {fa3: b"\0" * 4000, "sgl_kernel/__init__.py": "x = 1\n"}
    )
    plain = fake_wheel(out, "pydantic", "2.14.4", [], {"pydantic/__init__.py": "y = 2\n" * 50})
    own = fake_wheel(tmp_path / "dl", "sglang", "0.5.14", [], {"sglang/__init__.py": "z = 3\n"})
    eng = stage.ENGINES["sglang"]
    got = stage.rewrite_wheels(eng, {"sglang": own, "sglang-kernel": kernel, "pydantic": plain}, out)
    assert got["sglang-kernel"]["removed_uncompressed_bytes"] == 4000
    assert sm100 in got["sglang-kernel"]["absent"] and fa3 not in got["sglang-kernel"]["absent"]
    assert got["sglang-kernel"]["members"][fa3].startswith("FlashAttention 3")
    assert not own.exists() and sorted(p.name for p in out.iterdir()) == sorted(
        [kernel.name, plain.name, own.name]
    )
    for w in out.iterdir():
        with zipfile.ZipFile(w) as z:
            assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
            assert fa3 not in z.namelist()
    with zipfile.ZipFile(out / plain.name) as z:
        assert z.read("pydantic/__init__.py") == b"y = 2\n" * 50


def test_the_sglang_closure_gives_each_left_out_package_its_own_reason(stage, tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    wheels = {
        "sglang": fake_wheel(index, "sglang", "0.5.14", ["torch==2.11.0", "torchcodec==0.11.1", "fastapi", "numpy"]),
        "fastapi": fake_wheel(index, "fastapi", "0.165.0", ["starlette>=1.6.0"]),
        "starlette": fake_wheel(index, "starlette", "1.10.0", []),
    }  # fmt: skip
    monkeypatch.setattr(stage, "download", lambda spec, dest: wheels[stage.Requirement(spec).name])
    eng = stage.ENGINES["sglang"]
    got, left = stage.closure(["fastapi", "torchcodec==0.11.1", "torch==2.11.0", "numpy"], {"numpy"},
                              tmp_path, eng.skip, eng.pins)  # fmt: skip
    assert sorted(got) == ["fastapi", "starlette"]
    assert "video decoding" in left["torchcodec"] and "2.11.0+cu130" in left["torch"]
    assert left["numpy"] == "on the GPU machine"


def test_sglang_gets_its_own_transformers_and_tokenizers_although_the_image_has_both(
    stage, tmp_path, monkeypatch
):
    """The image's transformers 5.17 stops SGLang 0.5.14's server at import (its config registry names a
    model type 5.17 already defines), and transformers 5.8.1 refuses the image's tokenizers 0.23: both are
    staged into SGLang's site at the versions it accepts, while vLLM's staging leaves them to the image."""
    index = tmp_path / "index"
    index.mkdir()
    wheels = {
        "transformers": fake_wheel(index, "transformers", "5.8.1", ["tokenizers<=0.23.0,>=0.22.0", "numpy>=1.17"]),
        "tokenizers": fake_wheel(index, "tokenizers", "0.22.2", []),
    }  # fmt: skip
    asked = []

    def download(spec, dest):
        asked.append(spec)
        return wheels[stage.Requirement(spec).name]

    monkeypatch.setattr(stage, "download", download)
    image = {"transformers", "tokenizers", "numpy", "torch"}
    sg = stage.ENGINES["sglang"]
    got, left = stage.closure(
        ["transformers==5.8.1"], sg.counted_as_present(image), tmp_path, sg.skip, sg.pins
    )
    assert sorted(got) == ["tokenizers", "transformers"] and "tokenizers==0.22.2" in asked
    assert left == {"numpy": "on the GPU machine"}
    vllm = stage.ENGINES["vllm"]
    got, left = stage.closure(
        ["transformers==5.8.1"], vllm.counted_as_present(image), tmp_path, vllm.skip, vllm.pins
    )
    assert got == {} and left == {"transformers": "on the GPU machine"}


def test_the_device_script_picks_the_engines_folders_and_refuses_an_unknown_engine(tmp_path):
    sh = REPO / "tools" / "stage_vllm_gpu.sh"
    res = subprocess.run(["bash", str(sh), "env", "sglang"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0 and "PYTHONPATH=/tmp/site-sglang:" in res.stdout
    res = subprocess.run(["bash", str(sh), "env"], capture_output=True, text=True, cwd=REPO)
    assert "PYTHONPATH=/tmp/site:" in res.stdout
    part = tmp_path / "p1"
    part.mkdir()
    (part / "stage.part").write_bytes(b"x")
    (part / "manifest.json").write_text(json.dumps({"engine": "tgi; rm -rf /", "parts": []}))
    res = subprocess.run(["bash", str(sh), "receive", str(part)], capture_output=True, text=True)
    assert res.returncode == 2 and "is neither vllm nor sglang" in res.stderr
    res = subprocess.run(["bash", str(sh), "--help"], capture_output=True, text=True)
    assert "sglang-check [SECONDS]" in res.stdout and "/tmp/site-sglang" in res.stdout


def test_the_sglang_check_serves_on_flashinfer_with_eagle3(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    sys.modules.pop("stage_sglang_check", None)
    import stage_sglang_check as chk

    cmd = chk.server_command({"target": "/t", "drafter": "/d"}, 8012)
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and flags["--attention-backend"] == "flashinfer"
    assert flags["--speculative-algorithm"] == "EAGLE3" and flags["--speculative-draft-model-path"] == "/d"
    assert int(flags["--speculative-num-draft-tokens"]) == int(flags["--speculative-num-steps"]) + 1
    assert {"sglang.srt.models.llama_eagle3", "sglang.srt.speculative.dflash_worker_v2"} <= set(chk.IMPORTS)


def test_stage_hands_the_closure_the_image_less_what_the_engine_stages_over_it(stage, tmp_path, monkeypatch):
    """``stage()`` itself (not only ``closure``) leaves transformers and tokenizers out of what it counts as
    on the GPU machine for SGLang, and keeps them there for vLLM."""
    import argparse

    seen = {}

    class Stop(Exception):
        pass

    def closure(roots, have, *rest):
        seen["have"] = set(have)
        raise Stop

    monkeypatch.setattr(stage, "download", lambda spec, dest: fake_wheel(tmp_path, "eng", "1.0", []))
    monkeypatch.setattr(stage, "closure", closure)
    image = {"numpy", "transformers", "tokenizers"}
    for engine, kept in (("sglang", {"numpy"}), ("vllm", image)):
        args = argparse.Namespace(engine=engine, check=True, no_target=True, out=tmp_path / "o", part_mb=56)
        work = tmp_path / engine
        work.mkdir()
        with pytest.raises(Stop):
            stage.stage(args, image, [], work)
        assert seen["have"] == kept, engine


def test_the_engines_folders_are_those_the_device_script_exports(stage):
    """The table's ``site`` for each engine is the PYTHONPATH `stage_vllm_gpu.sh env ENGINE` prints (the
    script keeps its own copy of the paths), and an unknown engine is refused there."""
    sh = REPO / "tools" / "stage_vllm_gpu.sh"
    for name, eng in stage.ENGINES.items():
        res = subprocess.run(["bash", str(sh), "env", name], capture_output=True, text=True, cwd=REPO)
        assert res.returncode == 0 and f"PYTHONPATH={eng.site}:" in res.stdout, name
    res = subprocess.run(["bash", str(sh), "env", "sglng"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and "the engine is vllm or sglang, got 'sglng'" in res.stderr
