"""The checkpoint writers of docs/compatibility.md that t5_dcp/t5_orbax do not cover, each
through a real mount and read back bit for bit, after a remount of the same store:

- PyTorch DCP ``async_save`` with ``AsyncCheckpointerType.PROCESS`` (a checkpoint process
  of DCP's own, in a process group of one; run in a subprocess, because DCP spawns it);
- ``torch.save`` of a model and optimizer state, committed by ``mtcfs seal``;
- safetensors ``save_file`` (the Hugging Face format), committed by ``mtcfs seal``.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from support.ckpt import apply_dcp_state, assert_same, dcp_state, torch_train_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# The trainer of the process-based async save: its own script, because DCP's checkpoint
# process is started with "spawn" and re-imports __main__.
_DCP_PROCESS_SAVER = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    sys.path.insert(0, sys.argv[3])
    from support.ckpt import dcp_state, torch_train_state

    def main() -> None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = sys.argv[2]
        dist.init_process_group("gloo", rank=0, world_size=1)
        model, opt = torch_train_state(5)
        fut = dcp.async_save(dcp_state(model, opt), checkpoint_id=sys.argv[1],
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        fut.result(timeout=120)
        print("saved", flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
""")


def _free_port() -> int:
    from support.ports import free_port
    return free_port()


def _remount(mount) -> None:
    """A clean unmount and a mount of the same store: what is read after comes from the
    store, not from the page cache or the daemon's memory."""
    mount.stop()
    mount.start()


def test_dcp_async_save_in_a_checkpoint_process_is_bit_exact(mount, tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(_DCP_PROCESS_SAVER)
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    ckpt = str(mount.path("step_40"))
    r = subprocess.run([sys.executable, str(script), ckpt, str(_free_port()), tests_dir],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "saved" in r.stdout, r.stderr[-3000:]
    mount.wait_state("step_40", "local", timeout=30)
    assert [c["step"] for c in mount.checkpoints()] == ["step_40"]
    _remount(mount)

    model, opt = torch_train_state(5)
    want = copy.deepcopy(dcp_state(model, opt))
    fresh_model, fresh_opt = torch_train_state(999)
    got = dcp_state(fresh_model, fresh_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=ckpt)
    apply_dcp_state(fresh_model, fresh_opt, got)
    assert_same(want, got)
    assert_same(model.state_dict(), fresh_model.state_dict())


def test_torch_save_sealed_and_loaded_after_remount_is_bit_exact(mount):
    model, opt = torch_train_state(3)
    want = {"model": copy.deepcopy(model.state_dict()),
            "optim": copy.deepcopy(opt.state_dict())}
    mount.path("checkpoint-300").mkdir()
    torch.save(want, mount.path("checkpoint-300", "state.pt"))
    mount.cli("seal", str(mount.path("checkpoint-300")))
    assert mount.state("checkpoint-300") == "local"
    _remount(mount)

    got = torch.load(mount.path("checkpoint-300", "state.pt"), weights_only=True)
    assert_same(want, got)
    assert [(c["step"], c["committed_by"]) for c in mount.checkpoints()] == \
        [("checkpoint-300", "mtcfs seal")]


def test_safetensors_save_file_sealed_and_loaded_after_remount_is_bit_exact(mount):
    st = pytest.importorskip("safetensors.torch")
    model, _ = torch_train_state(4)
    want = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    want["embed.bf16"] = torch.randn(300, 64, generator=torch.Generator().manual_seed(4)
                                     ).to(torch.bfloat16)
    mount.path("checkpoint-400").mkdir()
    path = mount.path("checkpoint-400", "model.safetensors")
    st.save_file(want, str(path), metadata={"format": "pt"})
    mount.cli("seal", str(mount.path("checkpoint-400")))
    _remount(mount)

    got = st.load_file(str(path))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
