"""kvfleet operator: reconciles InferenceService objects with kopf.

Imported as ``kvfleet.operator``; never importable as the standard library's ``operator``.
"""
