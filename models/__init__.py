"""Plain-PyTorch models of kvrank: item encoder, ranker with multi-item scoring, CollectiveKV,
text teacher. Nothing in this package imports Ray."""
