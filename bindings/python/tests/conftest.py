"""pytest configuration: a report header saying which lmhead_torch is under test and whether the
GPU tests can run (they skip with the reason otherwise)."""

import torch

import lmhead_torch as L


def pytest_report_header(config):
    lines = [f"lmhead_torch {L.__version__} from {L.__file__}", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        names = ", ".join(f"{torch.cuda.get_device_name(i)} (cc {torch.cuda.get_device_capability(i)})" for i in range(torch.cuda.device_count()))
        lines.append(f"CUDA devices: {names}; lmhead supports the current one: {L.gpu_supported()}")
    else:
        lines.append("no CUDA device: GPU tests skip")
    if not L.gpu_supported():
        lines.append("tests/upstream: SkyRL's and verl's own files need a CUDA GPU the library supports: not run")
    return lines
