"""The comm thread is the worker's "comm" lane now (zeroedu/comm/worker.py, the one asynchronous mechanism); these
names stay for code that imports them from here."""

from __future__ import annotations

from zeroedu.comm.worker import Handle, Lane, Worker, worker

__all__ = ["Handle", "Lane", "Worker", "worker"]
