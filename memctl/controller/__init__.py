"""The controller: saved-tensor hooks, statistics, bit allocation, budget and batch size."""
