"""ovt's core library (README, "Layout").

Importing it sets one process default: PyTorch's CPU allocator backs tensors of 2 MB and more
with transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`, read by torch at its first allocation,
so it takes effect where no tensor was made before ovt was imported — as in ovt's commands and
daemons). A step at GPT-2 width makes gigabytes of fresh float64 buffers, and with 4 KB pages
their page faults cost more than the arithmetic on them (bench/README.md). Set
`THP_MEM_ALLOC_ENABLE=0` in the environment to keep them off.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
