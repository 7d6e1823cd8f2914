"""What a config adds to a stage: ZeRO++ (zeropp.py) and offload to CPU and NVMe (offload/)."""
