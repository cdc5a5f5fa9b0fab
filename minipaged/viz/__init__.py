"""Widgets: pure renderers (state -> SVG or matplotlib figure) under thin ipywidgets layers."""
