"""The kernel suites' shape matrix (test_04_kernels.py for decode, test_04_prefill.py for prefill).

Every head size against every block size; the group and the dtype rotate along, so each of them
meets several head sizes and block sizes without the whole product.
"""

import torch

GROUPS = [1, 4, 5, 8]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [  # (head_dim, block_size, group, dtype)
    (head_dim, block_size, GROUPS[i % 4], DTYPES[i % 3])
    for i, (head_dim, block_size) in enumerate((h, b) for h in (32, 64, 80, 96, 128) for b in (1, 3, 16, 48))
]


def shape_id(shape):
    head_dim, block_size, group, dtype = shape
    return f"d{head_dim}-bs{block_size}-g{group}-{str(dtype)[6:]}"
