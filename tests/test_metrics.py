"""The formulas behind the printed figures."""
import torch

from distlab import metrics as M


def test_flops_per_token_follows_palm_formula():
    # 6*(N - N_emb) + 12*L*H*Dh*S with N=1000, N_emb=200, L=2, H=4, Dh=8, S=16
    assert M.flops_per_token(1000, 200, 2, 4, 8, 16) == 6 * 800 + 12 * 2 * 4 * 8 * 16


def test_mfu_is_achieved_over_peak_and_empty_without_a_peak():
    assert M.mfu(100.0, 10.0, 2000.0) == 0.5
    assert M.mfu(100.0, 10.0, None) is None


def test_summarize_gives_median_and_spread():
    s = M.summarize([3.0, 1.0, 2.0, 10.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 10.0 and s["n"] == 4
    assert s["p25"] <= s["median"] <= s["p75"]


def test_state_bytes_count_params_grads_and_adam_state():
    model = torch.nn.Linear(10, 10)  # 110 fp32 params
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    state = M.model_state_bytes(model, opt)
    assert state["params"] == 110 * 4 and state["grads"] == 110 * 4
    # exp_avg + exp_avg_sq per param (8 bytes) + a scalar step tensor per parameter tensor
    assert 110 * 8 <= state["optimizer"] <= 110 * 8 + 2 * 8


def test_tied_or_viewed_tensors_are_counted_once():
    base = torch.zeros(100)
    assert M.tensor_bytes([base, base[:50], base.view(10, 10)]) == 400


def test_only_allow_listed_environment_lands_in_results(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert M.allowed_environment(["OMP_NUM_THREADS"]) == {"OMP_NUM_THREADS": "1"}


def test_a_machine_without_an_nvidia_driver_has_no_gpus_but_a_broken_driver_is_an_error(monkeypatch):
    import pynvml
    import pytest

    from distlab import hardware

    monkeypatch.delenv("DISTLAB_GPU_COUNT", raising=False)

    def missing():
        raise pynvml.NVMLError_LibraryNotFound()

    def broken():
        raise pynvml.NVMLError_Unknown()

    monkeypatch.setattr(pynvml, "nvmlInit", missing)
    assert hardware.gpu_count() == 0
    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    with pytest.raises(RuntimeError, match="NVML"):
        hardware.gpu_count()
