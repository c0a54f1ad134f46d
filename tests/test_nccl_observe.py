"""What NCCL really chose for a launch group's all-reduces, read from its debug output: the
parser on the line formats of real NCCL versions, the warning when a preset was not obeyed, and
the manifest entry a run writes for a group (from a fake job log: CI has no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from repaudit.run import nccl
from repaudit.run.nccl import debug_env, group_observation, mismatches, observe
from repaudit.run.rundir import Manifest

# NCCL 2.24 - 2.30, rank 0, subsystem TUNING. Format string of NVIDIA/nccl src/enqueue.cc
# (v2.24.3-1 line 678, v2.28.9-1 line 741): "%s: %ld Bytes -> Algo %s proto %s channel{Lo..Hi}={%d..%d}",
# names from ncclAlgoToString / ncclProtoToString (src/collectives.cc), prefix "%s:%d:%d [%d] NCCL INFO "
# (src/debug.cc); NCCL 2.26+ may put a "[date time] " timestamp first.
NCCL_2_28 = """\
gpu-node-1:51234:51234 [0] NCCL INFO AllReduce: 4194304 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..15}
gpu-node-1:51234:51234 [0] NCCL INFO AllReduce: 8192 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..1}
[2025-06-01 12:00:00] gpu-node-1:51234:51234 [0] NCCL INFO AllReduce: 16384 Bytes -> Algo NVLS_TREE proto SIMPLE channel{Lo..Hi}={0..3}
gpu-node-1:51234:51234 [0] NCCL INFO AllGather: 1048576 Bytes -> Algo RING proto LL128 channel{Lo..Hi}={0..3}
gpu-node-1:51234:51234 [0] NCCL INFO Broadcast: 8 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0}
"""
# NCCL 2.23: "%s: %ld Bytes -> Algo %d proto %d time %f" (v2.23.4-1 src/enqueue.cc line 1855), the
# numbers being NCCL_ALGO_* / NCCL_PROTO_* of src/include/nccl_common.h.
NCCL_2_23 = """\
gpu-node-1:51234:51234 [0] NCCL INFO AllReduce: 1048576 Bytes -> Algo 1 proto 2 time 34.693867
gpu-node-1:51234:51234 [0] NCCL INFO AllGather: 1048576 Bytes -> Algo 1 proto 1 time 20.000000
"""
# NCCL 2.20 - 2.22: "%ld Bytes -> Algo %d proto %d time %f" (v2.21.5-1 src/enqueue.cc line 1534) names
# no collective; the COLL line just before it from the same thread does (line 2022, "%s: opCount %lx
# sendbuff %p recvbuff %p count %zi datatype %d op %d root %d comm %p [nranks=%d] stream %p").
# Lines as printed in NVIDIA/nccl issues #1453 (tuning, with mpirun's "[0] " tag) and #203 (COLL).
NCCL_2_21 = """\
[0] h100clust-worker-1:497888:497888 [0] NCCL INFO AllReduce: opCount 1a sendbuff 0x10048f82700 recvbuff 0x10048f82800 count 65536 datatype 7 op 0 root 0 comm 0x7f0c741162f0 [nranks=2] stream 0x7f0c74002f00
[1] h100clust-worker-1:497889:497889 [1] NCCL INFO AllReduce: opCount 1a sendbuff 0x107b43e2300 recvbuff 0x107b43e1c00 count 65536 datatype 7 op 0 root 0 comm 0x7f0c7410f0e0 [nranks=2] stream 0x7f0c74001f60
[0] h100clust-worker-1:497888:497888 [0] NCCL INFO 262144 Bytes -> Algo 0 proto 1 time 54.707825
[0] h100clust-worker-1:497888:497888 [0] NCCL INFO AllGather: opCount 1b sendbuff 0x10051319000 recvbuff 0x1004af19000 count 237184 datatype 7 op 0 root 0 comm 0x7f0c741162f0 [nranks=2] stream 0x7f0c74002f00
[0] h100clust-worker-1:497888:497888 [0] NCCL INFO 948736 Bytes -> Algo 1 proto 2 time 12.000000
"""
# Lines that are not the formats above: a tuning table row, a channel listing, a warning, noise.
OTHER = """\
gpu-node-1:51234:51234 [0] NCCL INFO NCCL_ALGO set by environment to allreduce:tree
gpu-node-1:51234:51234 [0] NCCL INFO Channel 00/16 :    0   1
gpu-node-1:51234:51234 [0] NCCL INFO      AllReduce |    24.4/   0.0 |    38.5/   0.0 |
gpu-node-1:51234:51299 [0] transport.cc:42 NCCL WARN something
AllReduce: garbage Bytes -> Algo proto
\x00\xff binary junk {}[]:
"""


def test_parses_each_nccl_format_and_counts_only_all_reduces():
    assert observe(NCCL_2_28.splitlines()) == {
        "allreduces": 3, "algorithms": {"RING": 1, "TREE": 1, "NVLSTREE": 1}, "protocols": {"SIMPLE": 2, "LL": 1},
        "channels": [2, 4, 16]}
    assert observe(NCCL_2_23.splitlines()) == {
        "allreduces": 1, "algorithms": {"RING": 1}, "protocols": {"SIMPLE": 1}, "channels": []}
    # The tuning line is attributed through its own thread's COLL line, not rank 1's.
    assert observe(NCCL_2_21.splitlines()) == {
        "allreduces": 1, "algorithms": {"TREE": 1}, "protocols": {"LL128": 1}, "channels": []}


def test_unknown_formats_are_not_observed_and_never_crash(tmp_path: Path):
    assert observe(OTHER.splitlines())["allreduces"] == 0
    assert observe([])["allreduces"] == 0
    log = tmp_path / "g.1.log"
    log.write_bytes(OTHER.encode() + b"\xc3\x28 invalid utf-8\n")
    assert group_observation([log, tmp_path / "missing.log"], {"NCCL_ALGO": "Ring"}) == {
        "status": "not observed", "warnings": []}


def test_warns_where_nccl_did_not_do_what_the_preset_asked():
    seen = observe(NCCL_2_28.splitlines())
    assert mismatches(seen, nccl.PRESETS["default"]) == []
    assert mismatches(seen, nccl.PRESETS["tree"]) == [
        "NCCL_ALGO=allreduce:tree asked, but NCCL used NVLSTREE (1), RING (1) for all-reduces"]
    assert mismatches(seen, nccl.PRESETS["deterministic"]) == [
        "NCCL_ALGO=allreduce:tree asked, but NCCL used NVLSTREE (1), RING (1) for all-reduces",
        "NCCL_PROTO=Simple asked, but NCCL used LL (1) for all-reduces",
        "NCCL_MAX_NCHANNELS=1 asked, but NCCL used 16 channels for all-reduces"]
    # NCCL's own list syntax: exclusions, per-collective entries, any letter case.
    assert mismatches(seen, {"NCCL_ALGO": "^CollNetDirect", "NCCL_PROTO": "ll,simple;allgather:LL128"}) == []
    assert mismatches(seen, {"NCCL_ALGO": "Tree;allreduce:ring,tree,nvlstree", "NCCL_MIN_NCHANNELS": "32"}) == []
    assert mismatches(seen, {"NCCL_PROTO": "^LL"}) == ["NCCL_PROTO=^LL asked, but NCCL used LL (1) for all-reduces"]


def test_the_manifest_gets_the_summary_and_the_warning(tmp_path: Path):
    logs = []
    for n, text in enumerate((OTHER, NCCL_2_28), start=1):  # a failed first attempt, then the one that ran
        logs.append(tmp_path / f"hf-tp2-tree.{n}.log")
        logs[-1].write_text(text)
    manifest = Manifest.load_or_new(tmp_path)
    manifest.data.groups["hf-tp2-tree"] = {"attempts": 2}
    manifest.data.groups["hf-tp2-tree"]["nccl_observed"] = group_observation(logs, nccl.PRESETS["tree"])
    manifest.save()
    group = json.loads((tmp_path / "manifest.json").read_text())["groups"]["hf-tp2-tree"]
    assert group["nccl_observed"] == {
        "status": "observed", "allreduces": 3, "algorithms": {"RING": 1, "TREE": 1, "NVLSTREE": 1},
        "protocols": {"SIMPLE": 2, "LL": 1}, "channels": [2, 4, 16],
        "warnings": ["NCCL_ALGO=allreduce:tree asked, but NCCL used NVLSTREE (1), RING (1) for all-reduces"]}


def test_debug_variables_are_set_for_gpu_jobs_only(monkeypatch):
    from repaudit.run import runner as run

    assert debug_env((2, 27, 3)) == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING"}
    assert debug_env((2, 21, 5)) == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING,COLL"}
    assert debug_env(None)["NCCL_DEBUG_SUBSYS"] == "TUNING,COLL"
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # the user's own: a preset is the whole NCCL environment
    monkeypatch.setattr(run, "torch_nccl_version", lambda: (2, 27, 3))
    cpu = run._job_env({"NCCL_ALGO": "Ring"}, "cpu", 1)
    assert "NCCL_DEBUG" not in cpu and "NCCL_DEBUG_SUBSYS" not in cpu
    gpu = run._job_env({"NCCL_ALGO": "Ring"}, "cuda", 1)
    assert (gpu["NCCL_DEBUG"], gpu["NCCL_DEBUG_SUBSYS"], gpu["NCCL_ALGO"]) == ("INFO", "TUNING", "Ring")
    assert run._job_env({"NCCL_DEBUG_SUBSYS": "INIT"}, "cuda", 1)["NCCL_DEBUG_SUBSYS"] == "INIT"  # the preset wins


def test_a_gpu_run_records_what_nccl_did_per_launch_group(tmp_path: Path, monkeypatch, capsys):
    """`repaudit run --device cuda` end to end, with the job replaced by one that leaves NCCL's
    lines in its log as a real one would: the manifest's launch group holds the summary and the
    warning, and the terminal shows the warning."""
    import torch
    from rich.console import Console

    from repaudit import commands
    from repaudit.run import runner as run
    from repaudit.run.launch import CellOutcome, GroupOutcome
    from repaudit.run.plan import Matrix

    seen_env = {}

    def fake_job(spec, job_dir, *, env, **kw):
        seen_env.update(env)
        log = job_dir / f"{spec.group_id}.1.log"
        log.write_text(NCCL_2_28)
        return GroupOutcome(cells={c["id"]: CellOutcome("failed", "no GPU here") for c in spec.cells}, attempts=1,
                            logs=[log])

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(run, "run_group", fake_job)
    matrix = Matrix(model="builtin:tiny-qwen3", device="cuda", dtype="float32", probes="smoke", tps=(2,),
                    batch_sizes=(1,), modes=("generate",), nccl={"tree": nccl.PRESETS["tree"]})
    console = Console(record=True, width=300)
    commands.run(matrix, run.RunOptions(out=tmp_path / "run"), console)
    assert seen_env["NCCL_DEBUG"] == "INFO" and "TUNING" in seen_env["NCCL_DEBUG_SUBSYS"]
    groups = json.loads((tmp_path / "run" / "manifest.json").read_text())["groups"]
    (observed,) = [g["nccl_observed"] for g in groups.values()]
    assert observed["algorithms"] == {"RING": 1, "TREE": 1, "NVLSTREE": 1}
    assert observed["warnings"] == ["NCCL_ALGO=allreduce:tree asked, but NCCL used NVLSTREE (1), RING (1) for all-reduces"]
    assert "NCCL_ALGO=allreduce:tree asked, but NCCL used NVLSTREE (1), RING (1)" in " ".join(console.export_text().split())
