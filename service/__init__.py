"""The domain and everything around it that is not HTTP and not torch: one package per job (see README, Layout)."""
