"""Every check before a run starts: the config resolved into checked components, the start folders."""
