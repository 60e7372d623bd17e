"""kimilab: serving a hybrid linear-attention model, built up chapter by chapter."""
