"""Link bandwidths, one figure per link and per drive kind, shared by zeroedu.planner (its alpha-beta links) and
zeroedu.offload (LINKS and transfer_seconds: a step's transfer bytes -> time).

Peak bandwidth, bytes/s, one direction. Achieved bandwidth is typically 70-90% of these. Sources:

    NVLink 3     NVIDIA A100 datasheet: 600 GB/s per GPU, both directions together
    PCIe x16     PCI-SIG: 8, 16, 32 GT/s per lane (3.0, 4.0, 5.0) x 16 lanes after 128b/130b line coding
                 = 15.75, 31.5, 63 GB/s
    InfiniBand   per node: 8 x 200 Gb/s HDR InfiniBand ports for compute traffic (NVIDIA DGX A100 user guide)
                 = 200 GB/s
    Ethernet     per node: one 100 Gb/s Ethernet port (IEEE 802.3) = 12.5 GB/s
    NVMe SSD     vendor datasheets, typical sequential figures of current drives: PCIe 4.0 x4 about 7 GB/s read
                 and 6 GB/s write, PCIe 5.0 x4 about 14 GB/s read
"""

from __future__ import annotations

NVLINK3 = 300e9
PCIE3_X16 = 15.75e9
PCIE4_X16 = 31.5e9
PCIE5_X16 = 63.0e9
INFINIBAND_NODE = 200e9
ETHERNET_NODE = 12.5e9
NVME_PCIE4_READ = 7.0e9
NVME_PCIE4_WRITE = 6.0e9
NVME_PCIE5_READ = 14.0e9
