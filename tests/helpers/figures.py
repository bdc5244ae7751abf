"""Where a matplotlib figure's artists are drawn: for the tests that check legends and titles stay inside."""

from __future__ import annotations


def flat(text: str) -> str:
    """Text with its line breaks (from wrapping) as single spaces."""
    return " ".join(text.split())


def extent(fig, artist):
    """Where ``artist`` is drawn, in display pixels (the figure is laid out and drawn once)."""
    if not getattr(fig, "_test_drawn", False):
        fig.canvas.draw()
        fig._test_drawn = True
    return artist.get_window_extent(fig.canvas.get_renderer())


def assert_inside_figure(fig, artist) -> None:
    """The artist (a legend) is drawn wholly within the figure's canvas, i.e. within the PNG."""
    box, frame = extent(fig, artist), fig.bbox
    assert box.x0 >= frame.x0 - 1 and box.y0 >= frame.y0 - 1, (box, frame)
    assert box.x1 <= frame.x1 + 1 and box.y1 <= frame.y1 + 1, (box, frame)


def overlaps(fig, a, b) -> bool:
    return extent(fig, a).overlaps(extent(fig, b))


def data_axes(fig) -> list:
    """Visible axes that are not colour bars."""
    return [ax for ax in fig.axes if ax.get_visible() and not hasattr(ax, "_colorbar")]
