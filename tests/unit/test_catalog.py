"""The log-signature catalog against real log text.

Every catalog entry has at least one real line (source in the comment next to it) that must be
matched by that entry first, i.e. with the catalog's priority order. Host names in the quoted lines
were replaced by gpuNN as in tests/fixtures/logs/SOURCES.md; nothing else was changed. The healthy
cases of tests/fixtures/corpus/ must produce no anomaly at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from producers.joblogs import split_rank_prefix
from producers.kernel import parse_kernel_line, to_event
from schemas.events import LogBatch, LogLine
from streams.catalog import Signature, default_signatures, load_signatures
from streams.detectors.kernel_text import KernelTextDetector
from streams.detectors.signatures import SignatureDetector
from streams.detectors.xid import XidDetector
from tests.conftest import FIXTURES

CORPUS = FIXTURES / "corpus" / "dev"
DETECTOR = SignatureDetector()
ENTRIES: dict[str, Signature] = {s.id: s for s in default_signatures()}

# id -> real lines it must match first. The URL above each group is where the text was seen.
REAL_LINES: dict[str, list[str]] = {
    "srun_node_failure": [
        # https://github.com/huggingface/m4-logs/blob/7a31dcede8590cdfd8a0786f75141933fe5afb36/tr_141-hanging/tr_141_cm409xPMD01_scale_leap_of_faith_v5_num_workers_06/README.md
        "srun: error: Node failure on gpu02",
        # https://github.com/GoogleCloudPlatform/cluster-toolkit/issues/1600
        "srun: error: Node failure on gpu01",
        # https://github.com/nebius/soperator/issues/854
        "salloc: error: Node failure on worker-1",
    ],
    "bus_error": [
        # https://github.com/Blealtan/RWKV-LM-LoRA/issues/18 (docker shm too small)
        "train_cmd.sh: line 34:   894 Bus error               (core dumped) python train.py",
        # https://github.com/OreoChocolate/MUREN/issues/15
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -7) local_rank: 0 (pid: 3311)",
    ],
    "crash_exit_code": [
        # https://github.com/AFeng-x/SMT/issues/18
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0 (pid: 2694) of "
        "binary: /usr/bin/python",
        # https://github.com/FangyunWei/SLRT/issues/66 (torchrun's ChildFailedError table)
        "  exitcode  : 1 (pid: 2680830)",
        # https://github.com/mosaicml/llm-foundry (corpus/dev/unknown_llmfoundry_rank2_exit_code_minus7, cited there)
        (CORPUS / "unknown_llmfoundry_rank2_exit_code_minus7" / "job.out").read_text().splitlines()[-1],
        # https://github.com/ComputationalRadiationPhysics/picongpu/issues/198
        "srun: error: taurusi2031: tasks 10-11: Exited with exit code 1",
    ],
    "crash_signal": [
        # https://github.com/deepspeedai/Megatron-DeepSpeed/issues/207
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -6) local_rank: 0 (pid: 142437) of "
        "binary: /opt/conda/bin/python",
        # https://github.com/huggingface/trl/issues/1099 (torchrun's ChildFailedError table)
        "  exitcode  : -6 (pid: 5333)",
    ],
    "slurm_step_node_failure": [
        # https://github.com/huggingface/m4-logs/blob/7a31dcede8590cdfd8a0786f75141933fe5afb36/tr_141-hanging/tr_141_cm409xPMD01_scale_leap_of_faith_v5_num_workers_06/README.md
        "slurmstepd: error: *** STEP 1943824.0 ON gpu01 CANCELLED AT 2023-03-06T03:17:51 DUE TO NODE FAILURE, "
        "SEE SLURMCTLD LOG FOR DETAILS ***",
    ],
    "slurm_oom_kill": [
        # https://github.com/hafs-community/HAFS/issues/101
        "slurmstepd: error: Detected 1 oom-kill event(s) in step 3495064.0 cgroup. Some of your processes may have "
        "been killed by the cgroup out-of-memory handler.",
        # https://github.com/snakemake/snakemake-executor-plugin-slurm/pull/371 (newer Slurm wording)
        "slurmstepd: error: Detected 2 oom_kill events in StepId=JOBID.13. Some of the step tasks have been OOM Killed.",
    ],
    "srun_task_oom": [
        # https://github.com/hafs-community/HAFS/issues/101
        "srun: error: gpu01: task 4: Out Of Memory",
        # https://github.com/snakemake/snakemake-executor-plugin-slurm/pull/371
        "srun: error: NODE: task 0: Out Of Memory",
    ],
    "oom_killer": [
        # https://github.com/ymoslem/OpenNMT-Tutorial/issues/6
        "Memory cgroup out of memory: Killed process 629 (onmt_train) total-vm:14119556kB, anon-rss:6538204kB, "
        "file-rss:80652kB, shmem-rss:16kB, UID:0 pgtables:13432kB oom_score_adj:0",
    ],
    "process_sigkill": [
        # https://github.com/xiaomi-research/time-r1/issues/9
        "E0813 06:19:49.809000 161210 site-packages/torch/distributed/elastic/multiprocessing/api.py:869] failed "
        "(exitcode: -9) local_rank: 2 (pid: 161617) of binary: /mnt/hwnasbj/huixuan/miniconda3/envs/timer1/bin/python3.11",
        # https://github.com/apple/ml-recurrent-drafter/issues/5
        "  exitcode  : -9 (pid: 3309)",
        # https://github.com/hezhangsprinter/DCPDN/issues/12
        "RuntimeError: DataLoader worker (pid 19597) is killed by signal: Killed.",
        # https://github.com/ArjunaCluster/ArjunaUsers/issues/52
        "Killed",
        "/var/spool/slurmd/job00191/slurm_script: line 28:  8156 Killed                  python3 main.py --prop hform "
        "--epochs 400 --lr_milestones 50 100 200 --gamma 0.25 --normalizing_const_AO 10000.0 --lr_generator 0.001 "
        "--lr_conv 0.001",
    ],
    "cuda_oom": [
        # https://github.com/richard-peng-xia/MMed-RAG/issues/38
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacty of "
        "8.00 GiB of which 0 bytes is free. Of the allocated memory 22.44 GiB is allocated by PyTorch, and 3.16 MiB is "
        "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
        # https://github.com/Instruction-Tuning-with-GPT-4/GPT-4-LLM/issues/16
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 172.00 MiB (GPU 0; 79.35 GiB total capacity; "
        "73.95 GiB already allocated; 12.19 MiB free; 76.80 GiB reserved in total by PyTorch) If ",
        # https://github.com/NVIDIA/nccl/issues/1235 (NCCL's own allocation failing)
        "gpu01:3063028:3066152 [3] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'",
    ],
    "cuda_uncorrectable_ecc": [
        # https://github.com/jade-hpc-gpu/jade-hpc-gpu.github.io/issues/194
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        # https://github.com/kohya-ss/sd-scripts/issues/1434 (must win over the NCCL watchdog text)
        "[E ProcessGroupNCCL.cpp:916] [Rank 1] NCCL watchdog thread terminated with exception: CUDA error: "
        "uncorrectable ECC error encountered",
        # https://github.com/nagadit/DeepFaceLab_Linux/issues/89
        "F tensorflow/stream_executor/lib/statusor.cc:34] Attempting to fetch value instead of handling error "
        "Internal: failed initializing StreamExecutor for CUDA device ordinal 0: Internal: failed call to "
        "cuDevicePrimaryCtxRetain: CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered",
    ],
    "cuda_uncorrectable_nvlink": [
        # https://github.com/MIC-DKFZ/nnUNet/issues/1519
        "RuntimeError: CUDA error: uncorrectable NVLink error detected during the execution",
    ],
    "cuda_unknown_error": [
        # https://github.com/bigscience-workshop/bigscience/blob/e726b15982fa088fb6d9a4c869c19c3d4dbc84a7/train/tr11-176B-ml/chronicles.md
        "[default3]:  what():  CUDA error: unknown error",
        # https://github.com/NVIDIA/nccl/issues/1653
        "gpu01:1689:2800 [0] include/alloc.h:112 NCCL WARN Cuda failure 999 'unknown error'",
    ],
    "cuda_launch_failure": [
        # https://github.com/microsoft/human-pose-estimation.pytorch/issues/21
        "THCudaCheck FAIL file=/pytorch/aten/src/THC/generated/../generic/THCTensorMathPointwise.cu line=265 "
        "error=4 : unspecified launch failure",
        # https://github.com/XPixelGroup/BasicSR/issues/211
        "RuntimeError: CUDA error: unspecified launch failure",
    ],
    "cuda_illegal_memory_access": [
        # https://github.com/hpcaitech/Open-Sora/issues/694
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        # https://github.com/sgl-project/sglang/issues/8296
        "  what():  [PG ID 2 PG GUID 3 Rank 1] Process group watchdog thread terminated with exception: CUDA error: "
        "an illegal memory access was encountered",
    ],
    "cuda_device_assert": [
        # https://github.com/deepspeedai/Megatron-DeepSpeed/issues/207
        "../aten/src/ATen/native/cuda/Indexing.cu:1141: indexSelectLargeIndex: block: [615,0,0], thread: [121,0,0] "
        "Assertion `srcIndex < srcSelectDimSize` failed.",
        # https://github.com/NVIDIA/flowtron/issues/52
        "RuntimeError: CUDA error: device-side assert triggered",
        "C:/cb/pytorch_1000000000000/work/aten/src/THC/THCTensorIndex.cu:218: block: [0,0,0], thread: [3,0,0] "
        "Assertion `srcIndex < srcSelectDimSize` failed.",
    ],
    "segfault": [
        # https://github.com/pytorch/pytorch/issues/135486 (srun --label prefix "0: ")
        "0: Fatal Python error: Segmentation fault",
        "0: E0909 14:03:50.013000 22579342468928 torch/distributed/elastic/multiprocessing/api.py:833] failed "
        "(exitcode: -11) local_rank: 0 (pid: 2128869) of binary: <deracted for brevity>torch.mi250/python_environment/bin/python",
        # https://github.com/MhLiao/DB/issues/94
        "RuntimeError: DataLoader worker (pid 25902) is killed by signal: Segmentation fault",
    ],
    "ib_port_error": [
        # https://github.com/Lightning-AI/lit-llama/issues/380
        "gpu01:34050:34121 [0] transport/net_ib.cc:93 NCCL WARN NET/IB : Got async event : port error",
        # https://github.com/NVIDIA/nccl/issues/905 (quoted without the host prefix)
        "NCCL WARN NET/IB : Got async event : port error",
        # https://github.com/NVIDIA/nccl/issues/230 (mpirun prefix in front of the host)
        "2019-06-02T16:13:44.884Z: [1,12]<stdout>:gpu01:815:864 [0] transport/net_ib.cu:80 NCCL WARN NET/IB : "
        "Got async event : local catastrophic error",
    ],
    "ib_link_down": [
        # https://lore.kernel.org/all/cover.1737290406.git.leon@kernel.org (the kernel's own example)
        "mlx5_core 0000:08:00.0 mlx5_0: Port: 1 Link DOWN",
    ],
    "nccl_ib_completion_error": [
        # https://github.com/NVIDIA/nccl/issues/902
        "NCCL WARN NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129",
        # https://github.com/NVIDIA/nccl/issues/1814 (NCCL >= 2.19 wording: status=)
        "gpu01:984:1357 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<44206> with "
        "status=12 opcode=129 len=65536 vendor err 129 (Recv) localGid ::ffff:10.0.0.1 remoteGids::ffff:10.0.0.3",
        # https://github.com/NVIDIA/nccl/issues/1664 (IB plugin name NET/IBP)
        "NET/IBP:Got completion from peer 7.6.13.83<36315> with status=12 opcode=32698 len=32696 vendor err 129 (Send)",
        # https://github.com/tatsu-lab/stanford_alpaca/issues/207 (one line holding several NCCL texts)
        "[E ProcessGroupNCCL.cpp:455] Some NCCL operations have failed or timed out. Due to the asynchronous nature "
        "of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data. [E ProcessGroupNCCL.cpp:460] "
        "To avoid data inconsistency, we are taking the entire process down. terminate called after throwing an "
        "instance of 'std::runtime_error' what(): NCCL error: remote process exited or there was a network error, "
        "NCCL version 2.14.3 ncclRemoteError: A call failed possibly due to a network error or a remote process "
        "exiting prematurely. Last error: NET/IB : Got completion from peer 11.214.147.122<39138> with error 12, "
        "opcode 0, len 0, vendor err 129",
    ],
    "nccl_unhandled_cuda_error": [
        # https://github.com/NVIDIA/nccl/issues/1410
        "[rank7]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5",
    ],
    "nccl_unhandled_system_error": [
        # https://github.com/hkproj/pytorch-transformer-distributed/issues/1
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1333, "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.18.6",
    ],
    "nccl_remote_error": [
        # https://github.com/NVIDIA/nccl/issues/2076
        "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, "
        "remote process exited or there was a network error, NCCL version 2.21.5",
        # https://github.com/deepspeedai/DeepSpeed/issues/6875
        "[rank4]:[E1229 16:47:25.333820755 ProcessGroupNCCL.cpp:541] [Rank 4] found async exception when checking for "
        "NCCL errors: NCCL error: remote process exited or there was a network error, NCCL version 2.22.3",
    ],
    "nccl_heartbeat_hang": [
        # https://github.com/Intellindust-AI-Lab/DEIM/issues/105
        "[rank1]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 1] Heartbeat monitor timed out! Process will be terminated "
        "after dumping debug info. workMetaList_.size()=103",
        # https://github.com/verl-project/verl/issues/1158
        "[rank2]:[E419 10:53:25.421620797 ProcessGroupNCCL.cpp:1484] [PG ID 2 PG GUID 9 Rank 2] ProcessGroupNCCL's "
        "watchdog got stuck for 480 seconds without making progress in monitoring enqueued collectives. This "
        "typically indicates a NCCL/CUDA API (e.g., CudaEventDestroy) hang blocking the watchdog, and could be "
        "triggered by another thread holding the GIL inside a CUDA api (for example, CudaEventDestroy), or other "
        "deadlock-prone behaviors.If you suspect the watchdog is not actually stuck and a longer timeout would help, "
        "you can either increase the timeout (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC) to a larger value or disable the "
        "heartbeat monitor (TORCH_NCCL_ENABLE_MONITORING=0).If either of aforementioned helps, feel free to file an "
        "issue to PyTorch about the short timeout or false positive abort; otherwise, please attempt to debug the "
        "hang. ",
    ],
    "nccl_watchdog_timeout": [
        # https://github.com/hiyouga/LlamaFactory/issues/6269
        "[rank0]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, NumelIn=544997376, NumelOut=68124672, "
        "Timeout(ms)=600000) ran for 600061 milliseconds before timing out.",
        # https://github.com/instructlab/training/pull/520 (C++ "what():" form, must not count as a Python exception)
        "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated with exception: "
        "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, "
        "NumelOut=1, Timeout(ms)=1) ran for 90 milliseconds before timing out.",
        # https://github.com/hiyouga/LlamaFactory/issues/8261 (torch >= 2.4 wording; "[1803] " is the reporter's)
        "[1803] [rank1]:[E602 11:17:52.557891708 ProcessGroupNCCL.cpp:1743] [PG ID 0 PG GUID 0(default_pg) Rank 1] "
        "Received a dump signal due to a collective timeout from this local rank and we will try our best to dump "
        "the debug info. Last enqueued NCCL work: 6, last completed NCCL work: 6.This is most likely caused by "
        "incorrect usages of collectives, e.g., wrong sizes used across ranks, the order of collectives is not same "
        "for all ranks or the scheduled collective, for some reason, didn't run. Additionally, this can be caused by "
        "GIL deadlock or other reasons such as network errors or bugs in the communications library (e.g. NCCL), etc. ",
    ],
    "nan_loss": [
        # https://github.com/facebookresearch/detectron2/issues/838
        "FloatingPointError: Loss became infinite or NaN at iteration=2137!",
        # https://github.com/vpetren/gradnorm_tf/issues/17
        "epoch: 3451 loss: nan",
        # https://github.com/liyih/RCTrans/issues/6
        (CORPUS / "num_mmdet_loss_nan" / "job.out").read_text().splitlines()[0],
        # https://github.com/intel/ipex-llm/issues/1486
        "2017-08-20 16:11:46 INFO  DistriOptimizer$:295 - [Epoch 64 740096/1281167][Iteration 45459][Wall Clock "
        "197340.717246379s] Train 1792 in 4.006890034seconds. Throughput is 447.22968 records/second. Loss is "
        "Infinity. Current learning rate is 0.046281366472703075. Current weight decay is 1.0E-4. Current momentum "
        "is 0.9.",
    ],
    "megatron_nan_grad_norm": [
        # https://github.com/bigscience-workshop/Megatron-DeepSpeed/issues/396
        " iteration     5426/  250000 | consumed samples:        43408 | consumed tokens:     88899584 | elapsed time "
        "per iteration (ms): 4247.9 | learning rate: 2.999E-04 | global batch size:     8 | loss scale: 1.0 | grad "
        "norm: nan | actual seqlen:  2048 | number of skipped iterations:   0 | number of nan iterations:   0 | "
        "samples per second: 1.883 | TFLOPs: 78.36 |",
    ],
    "megatron_nan_check": [
        # https://github.com/alibaba/Pai-Megatron-Patch/issues/60
        "AssertionError: Rank 3: found NaN in local grad norm in backwards pass. Device: 3, node: gpu01",
        # https://github.com/alibaba/Pai-Megatron-Patch/issues/366
        "AssertionError: Rank 11: found NaN in local grad norm in backward pass before data-parallel communication "
        "collective. Device: 3",
    ],
    "fp16_loss_scale_exhausted": [
        # https://github.com/hiyouga/LlamaFactory/issues/315
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
    ],
    "fp16_loss_scale_near_floor": [
        # https://github.com/ymcui/Chinese-LLaMA-Alpaca/issues/534
        "[2023-06-07 22:24:46,260] [INFO] [loss_scaler.py:181:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping "
        "step. Attempted loss scale: 4, reducing to 2",
        # https://github.com/deepspeedai/DeepSpeed/pull/1593
        "[deepscale] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1",
    ],
    "storage_no_space": [
        # https://github.com/databrickslabs/dolly/issues/139
        "2023-04-29 06:01:12.977 [177/train/578 (pid 28936)] [09c561ee-a44c-4795-967c-7183a83b3160] OSError: "
        "[Errno 28] No space left on device",
        # https://github.com/babysor/MockingBird/issues/774
        "OSError: [Errno 28] No space left on device",
    ],
    "storage_quota_exceeded": [
        # https://github.com/NOAA-EPIC/EAGLE/issues/121
        "OSError: [Errno 122] Disk quota exceeded",
        # https://github.com/KennthShang/HostG/issues/7
        "OSError: [Errno 122] Disk quota exceeded: 'out/intermediate.ntw'",
    ],
    "storage_stale_handle": [
        # https://github.com/nanoporetech/taiyaki/issues/66
        "OSError: [Errno 116] Stale file handle",
        # https://github.com/modelscope/ms-swift/issues/6695
        "[rank1]: OSError: [Errno 116] Stale file handle: xxx",
    ],
    "storage_io_error": [
        # https://github.com/pytorch/pytorch/issues/10577
        "RuntimeError: write(): fd 29 failed with Input/output error",
        # https://github.com/Azure/az-hop/issues/574
        " kernel:LustreError: 1474:0:(lcommon_cl.c:147:cl_file_inode_init()) ASSERTION( (((inode->i_mode) & "
        "00170000) == 0100000) ) failed:",
    ],
    "checkpoint_write_failed": [
        # https://github.com/hiyouga/LlamaFactory/issues/1223
        "RuntimeError: [enforce fail at inline_container.cc:445] . PytorchStreamWriter failed writing file data/176: "
        "file write failed",
        # https://github.com/SWivid/F5-TTS/issues/458
        "[rank0]: RuntimeError: [enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
        "data.pkl: file write failed",
    ],
    "python_exception": [
        # https://github.com/ellenmellon/DIALKI/issues/3
        "AttributeError: 'RandomSampler' object has no attribute 'current_offset'",
        # https://github.com/huggingface/m4-logs/blob/7a31dcede8590cdfd8a0786f75141933fe5afb36/tr_141-hanging/tr_141_cm409xPMD01_scale_leap_of_faith_v5_num_workers_0-try3/README.md
        "ValueError: 'jsonl' is not a valid LoggingTypes",
        # https://github.com/NSO-developer/ncs_pycli/issues/6 (dotted exception name)
        "_ncs.error.Error: system call failed (24): Failed to connect to ConfD: Connection refused",
    ],
}

# Real harmless or collateral-only lines that no entry may match.
NOISE_LINES: list[str] = [
    # https://github.com/liguodongiot/llm-action/blob/0434459852401834455c3ea9b375bb35cf6dac4e/train/megatron/gpt2/README.md
    " iteration      100/    5000 | consumed samples:         1600 | elapsed time per iteration (ms): 858.6 | learning "
    "rate: 3.984E-06 | global batch size:    16 | lm loss: 9.674668E+00 | loss scale: 262144.0 | grad norm: 3.750 | "
    "number of skipped iterations:  15 | number of nan iterations:   0 |",
    # https://github.com/JiaquanYe/TableMASTER-mmocr/issues/32 (fp16 overflow step; maintainer: normal)
    " Epoch [1][100/62598]\tlr: 1.000e-03, eta: 6 days, 15:22:46, time: 0.539, data_time: 0.051, memory: 7239, "
    "loss_ce: 1.2757, horizon_bbox_loss: 0.2828, vertical_bbox_loss: 0.3507, loss: 1.9091, grad_norm: nan",
    # https://github.com/kenziyuliu/MS-G3D/issues/9
    "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 131072.0",
    # https://github.com/deepspeedai/DeepSpeed/issues/931
    "[2023-04-28 06:51:30,648] [INFO] [loss_scaler.py:181:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
    "Attempted loss scale: 65536, reducing to 32768",
    # https://github.com/ZettaAI/zetta_utils/issues/671 (a time limit, not a fault; "..." is the reporter's)
    "slurmstepd: error: *** JOB 494583 ON ... CANCELLED AT 2024-04-20T09:09:37 DUE TO TIME LIMIT ***",
    # https://github.com/hafs-community/HAFS/issues/101 (step teardown; the cause is a separate line)
    "slurmstepd: error: *** STEP 3495064.0 ON gpu01 CANCELLED AT 2021-10-27T19:35:36 ***",
    # https://github.com/deepspeedai/DeepSpeed/issues/6875 (NCCL result string, not a Python exception)
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
    # https://github.com/hkproj/pytorch-transformer-distributed/issues/1
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. ",
    # https://github.com/apple/ml-recurrent-drafter/issues/5 (launcher summary header; the cause is elsewhere)
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    # https://github.com/ellenmellon/DIALKI/issues/3
    "/opt/conda/lib/python3.8/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py:357: UserWarning: ",
    # https://github.com/pytorch/PiPPy/issues/158 (c10d retries the connection)
    "[W socket.cpp:558] [c10d] The client socket has failed to connect to [localhost]:29500 (errno: 99 - Cannot "
    "assign requested address).",
    # https://github.com/leptonai/gpud/pull/1209 (the port coming up)
    "Feb 14 05:03:41 000-000-00000-1-gpu-1 kernel: mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE",
    # https://github.com/Avarok-Cybersecurity/dgx-vllm/issues/16
    "(APIServer pid=1) Retrying in 8s [Retry 4/5].",
    # https://github.com/NVIDIA/nccl/issues/766
    "gpu01:1379562:1379562 [0] misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so[.1]",
    # At the end, so the ids of the lines above stay as tests/ids-before.txt has them.
    # https://github.com/deepspeedai/DeepSpeed/issues/386 (start of training: halvings far above the floor;
    # 16777216.0 and 2147483648.0 begin with a 1 and a 2, which must not read as a scale of 1 or 2)
    "[2020-09-09 01:52:33,739] [INFO] [stage2.py:1132:step] [deepscale] OVERFLOW! Rank 0 Skipping step. Attempted "
    "loss scale: 33554432.0, reducing to 16777216.0",
    "[2020-09-09 01:52:29,086] [INFO] [stage2.py:1132:step] [deepscale] OVERFLOW! Rank 0 Skipping step. Attempted "
    "loss scale: 4294967296, reducing to 2147483648.0",
]


def first_match(raw: str) -> tuple[Signature, dict[str, str | None]] | None:
    hit = DETECTOR.match_line(split_rank_prefix(raw).text)
    return None if hit is None else (hit[0], hit[1].groupdict())


def test_catalog_loads_and_is_cited() -> None:
    sigs = load_signatures()
    assert len({s.id for s in sigs}) == len(sigs)
    assert all(s.source.startswith("https://") for s in sigs)
    assert sigs[-1].id == "python_exception"  # the generic entry is last: everything specific wins


def test_every_entry_has_real_lines() -> None:
    assert set(REAL_LINES) == set(ENTRIES)


@pytest.mark.parametrize("sig_id", list(ENTRIES))
def test_entry_matches_its_real_lines(sig_id: str) -> None:
    for raw in REAL_LINES[sig_id]:
        hit = first_match(raw)
        assert hit is not None, f"{sig_id}: no match for {raw!r}"
        assert hit[0].id == sig_id, f"{sig_id}: {raw!r} matched {hit[0].id} first"


@pytest.mark.parametrize("raw", NOISE_LINES)
def test_noise_lines_match_nothing(raw: str) -> None:
    hit = first_match(raw)
    assert hit is None, f"{raw!r} matched {hit[0].id if hit else ''}"


@pytest.mark.parametrize(
    ("raw", "node"),
    [
        ("srun: error: Node failure on gpu02", "gpu02"),
        ("gpu01:34050:34121 [0] transport/net_ib.cc:93 NCCL WARN NET/IB : Got async event : port error", "gpu01"),
        (
            "2019-06-02T16:13:44.884Z: [1,12]<stdout>:gpu01:815:864 [0] transport/net_ib.cu:80 NCCL WARN NET/IB : "
            "Got async event : local catastrophic error",
            "gpu01",
        ),
        ("NCCL WARN NET/IB : Got async event : port error", None),
    ],
)
def test_node_named_in_the_line(raw: str, node: str | None) -> None:
    hit = first_match(raw)
    assert hit is not None and hit[1].get("node") == node


def test_node_group_sets_anomaly_node() -> None:
    line = "gpu01:34050:34121 [0] transport/net_ib.cc:93 NCCL WARN NET/IB : Got async event : port error"
    batch = LogBatch(event_id="b", event_time=0.0, job_id="7", source="s", lines=[LogLine(text=line, ts=1.0, lineno=1)])
    (a,) = DETECTOR.detect(batch)
    assert (a.signature, a.node, a.isolate, a.category) == ("ib_port_error", "gpu01", True, "interconnect")


def _healthy_cases() -> list[Path]:
    cases = []
    for case in sorted(p for p in CORPUS.iterdir() if p.is_dir()):
        if yaml.safe_load((case / "label.yaml").read_text())["category"] == "healthy":
            cases.append(case)
    return cases


def test_corpus_has_enough_healthy_cases() -> None:
    assert len(_healthy_cases()) >= 10


@pytest.mark.parametrize("case", _healthy_cases(), ids=lambda p: p.name)
def test_healthy_corpus_has_no_anomaly(case: Path) -> None:
    xids, kernel = XidDetector(), KernelTextDetector()
    for path in sorted(p for p in case.iterdir() if p.name != "label.yaml"):
        for raw in path.read_text().splitlines():
            parsed = parse_kernel_line(raw, default_node="n")
            if parsed is not None:
                event = to_event(parsed, 0.0)
                assert xids.detect(event) == [] and kernel.detect(event) == [], f"{path.name}: {raw!r}"
            hit = first_match(raw)
            assert hit is None, f"{path.name}: {hit[0].id if hit else ''} on {raw!r}"
