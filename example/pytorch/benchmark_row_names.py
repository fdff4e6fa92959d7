"""The rows of benchmark_synthetic.py's suite by name (benchmark_rows.py runs them): without
torch, so that the suite's driver, which only launches the ranks, does not import it."""
CODECS = {"onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          "topk 1%+EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"},
          "DGC 0.1%": {"compressor": "dgc", "k": 0.001}}
PS_CODEC = "topk 1%+EF"
BASELINE = "DDP no communication"
COLLECTIVE_ROWS = (BASELINE, "DDP allreduce", "DDP fp16 hook", "DDP PowerSGD rank 1", "DDP PowerSGD rank 4",
                   *(f"bps_gc hook {c}" for c in CODECS))
PS_ROW = f"DistributedOptimizer {PS_CODEC} (parameter server)"
ROWS = COLLECTIVE_ROWS + (PS_ROW,)
