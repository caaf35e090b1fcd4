"""kvfleet operator: reconciles InferenceService objects (kopf). Imported as ``kvfleet.operator``."""
