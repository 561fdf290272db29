"""The running job: process group, run-folder lock, durable file writes, stop signals, stall watchdog, lost peers."""
