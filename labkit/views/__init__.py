"""What the notebook shows: rank output, metrics tables, dashboards, timelines, reports.

matplotlib and ipywidgets load with the first view that draws, not before.
"""
