"""Callbacks: user code attached to the trainer's lifecycle hooks, and the standard set."""

from dream_trainer.callbacks.early_stopping import EarlyStopping
from dream_trainer.callbacks.ema import EMA
from dream_trainer.callbacks.garbage_collection import GarbageCollection
from dream_trainer.callbacks.hang_watchdog import HangWatchdog
from dream_trainer.callbacks.histograms import Histograms
from dream_trainer.callbacks.lr_monitor import LRMonitor
from dream_trainer.callbacks.media_logger import MediaLogger
from dream_trainer.callbacks.nan_guard import NanGuard
from dream_trainer.callbacks.profiler import Profiler
from dream_trainer.callbacks.progress_bar import ProgressBar
from dream_trainer.callbacks.reference_log_probs import ReferenceLogProbs
from dream_trainer.callbacks.summaries import ModelSummary, TrainerSummary
from dream_trainer.callbacks.throughput import Throughput
from dream_trainer.trainer.callback import Callback, RankZeroCallback
from dream_trainer.trainer.callback_collection import CallbackCollection
from dream_trainer.trainer.hooks import HOOK_NAMES, TrainerHooks

__all__ = ["EMA", "HOOK_NAMES", "Callback", "CallbackCollection", "EarlyStopping",
           "GarbageCollection", "HangWatchdog", "Histograms", "LRMonitor", "MediaLogger",
           "ModelSummary", "NanGuard", "Profiler", "ProgressBar", "RankZeroCallback",
           "ReferenceLogProbs", "Throughput", "TrainerHooks", "TrainerSummary"]
