"""compile_train_step under DistributedDataParallel on CUDA over NCCL: the scenarios of test_ddp_train_step.py (IEEE
fp32, against eager DDP in the same processes), plain and replayed as CUDA graphs (the collectives captured with the
step) -- on 2 GPUs; on one, a single rank: the same graphs, kernels on gathered operands and NCCL collectives (of one
rank), the semantics across ranks being checked on CPU."""
import pytest
import torch

from test_ddp_train_step import check, run_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h100-x2)")
@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "cuda_graphs"])
def test_cuda_ddp_step_matches_eager_ddp(tmp_path, graphs):
    check(run_ranks(tmp_path, "cuda", cuda_graphs=graphs), graphs=graphs)


@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "cuda_graphs"])
def test_cuda_ddp_step_one_rank_over_nccl(tmp_path, graphs):
    check(run_ranks(tmp_path, "cuda", world=1, cuda_graphs=graphs), graphs=graphs)
