"""Cluster runtime: controller, workers, messages."""
