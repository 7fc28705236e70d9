"""compile_train_step under DistributedDataParallel on CUDA: the scenarios of test_ddp_train_step.py (IEEE fp32,
against eager DDP in the same processes) -- on 2 GPUs over NCCL, also replayed as CUDA graphs (the collectives
captured with the step); on one GPU, two ranks share it over gloo (the fused CUDA kernels on gathered operands)."""
import pytest
import torch

from test_ddp_train_step import check, run_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h100-x2)")
@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "cuda_graphs"])
def test_cuda_ddp_step_matches_eager_ddp(tmp_path, graphs):
    check(run_ranks(tmp_path, "cuda", cuda_graphs=graphs), graphs=graphs)


def test_cuda_ddp_step_two_ranks_on_one_gpu_over_gloo(tmp_path):
    if torch.cuda.device_count() >= 2:
        pytest.skip("2 GPUs: the NCCL test above covers it")
    check(run_ranks(tmp_path, "cuda"))
