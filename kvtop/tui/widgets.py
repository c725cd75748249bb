"""``LiveTable``: a ``DataTable`` whose cells are re-rendered only when their content changed.

Textual's ``DataTable`` keys every render cache on a table-wide update counter, so one
``update_cell`` (or ``add_row``/``remove_row``) re-renders every visible cell through Rich on
the next frame: at 4 Hz with 64 instances that was most of attach's CPU. ``LiveTable`` draws
its data rows itself through Textual's public Line API (``render_line``): each cell is
rendered the way ``DataTable`` renders it (``Styled(Padding(cell))`` with the table's
component styles: zebra rows, the fixed column, the cursor and the mouse hover) and kept,
keyed by the identity of the cell's value (the app replaces a value only when its text
changed) and the styles and width it was drawn with, without the ``row``/``column`` mouse
meta, which is added per frame: rows that only moved (a sort, the decision log dropping its
oldest rows) are not re-rendered either. The header, and any table shape kvtop does not use
(multi-line rows, fixed rows, row labels, a cell or column cursor), go through
``DataTable.render_line``. Only Textual's public API is used, so the version can float within
a major release; tests/test_tui.py checks every line against ``DataTable``'s own.
"""

from __future__ import annotations

from typing import Any

from rich.padding import Padding
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.coordinate import Coordinate
from textual.geometry import Region
from textual.renderables.styled import Styled
from textual.strip import Strip
from textual.widgets import DataTable

_FIXED_META = Style.from_meta({"fixed": True})


_JOIN = Text("")


def fast_cell_segments(console: Any, value: Any, width: int, padding: int, pre: Style, post: Style
                       ) -> list[Segment] | None:
    """The segments ``Styled(Padding(cell_renderable(value), (0, padding)), pre, post)`` renders,
    made directly for the common cell: one line of text (a ``Text`` or a str without markup)
    that fits its width, left-justified. None for anything else (Rich renders it then).

    Rendering through Rich's Padding and Styled costs about ten times as much, and at 256
    instances the overview re-renders every visible cell a frame. tests/test_tui.py checks
    every line against ``DataTable``'s own.
    """
    if isinstance(value, str):
        if "[" in value or not value.isprintable():
            return None  # markup, a line break, a tab, a control code: Rich's rules
        text = Text(value)
    elif type(value) is Text:
        text = value
        if text.justify not in (None, "default", "left") or text.overflow == "ignore":
            return None
        plain = text.plain
        if not plain.isprintable():
            return None
    else:
        return None
    inner = width - 2 * padding
    length = text.cell_len
    if inner < 1 or length > inner:
        return None  # cut to the width: Rich's overflow rules
    segments: list[Segment] = []
    add = segments.append
    side = pre + post if post else pre
    if padding:
        add(Segment(" " * padding, side))
    # as Text.__rich_console__ renders one line: its own style becomes a span (Text.join)
    for seg in (_JOIN.join([text]) if text.style else text).render(console):
        style = pre + seg.style if seg.style else pre
        add(Segment(seg.text, style + post if post else style))
    rest = inner - length + padding
    if rest:
        add(Segment(" " * rest, side))
    return segments


def cell_renderable(value: Any) -> Any:
    """A cell's value as ``DataTable`` displays a one-line cell (its ``default_cell_formatter``)."""
    if value is None:
        return Text()
    if isinstance(value, str):
        text = Text.from_markup(value.split("\n", 1)[0], end="")
        text.no_wrap = True
        return text
    if isinstance(value, float):
        return Text(f"{value:.2f}", no_wrap=True, end="")
    if isinstance(value, (Text,)) or hasattr(value, "__rich_console__") or hasattr(value, "__rich__"):
        return value
    return Text(str(value), no_wrap=True, end="")


class LiveTable(DataTable):
    """A ``DataTable`` with a content-keyed cell cache (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._deferring = False  # inside set_cells: one refresh at the end
        super().__init__(*args, **kwargs)
        # row key -> column key -> (value, the state it was drawn in, segments without meta,
        # the (row, column) they were last placed at, those segments with that mouse meta)
        self._cells_drawn: dict[Any, dict[Any, tuple]] = {}
        self._meta: dict[tuple[int, int], Style] = {}
        self._styles: dict[tuple, Style] | None = None  # component styles, until the theme or CSS changes
        self._frame_style: Style | None = None
        self._frame_pseudo: Any = None
        self._mouse_over = False  # the hover highlight follows the mouse, not the keys (as DataTable's)

    # -- updates ----------------------------------------------------------------------------
    def set_cells(self, row_key: Any, values: dict[str, Any]) -> None:
        """``update_cell`` for several cells of one row, with one refresh instead of one each."""
        if not values:
            return
        self._deferring = True
        try:
            for column_key, value in values.items():
                self.update_cell(row_key, column_key, value)
        finally:
            self._deferring = False
        self.refresh()

    def refresh(self, *regions: Any, **kwargs: Any) -> Any:
        if self._deferring:
            return self
        return super().refresh(*regions, **kwargs)

    def remove_row(self, row_key: Any) -> None:
        super().remove_row(row_key)
        self._cells_drawn.pop(row_key, None)  # RowKey hashes and compares like its str

    def clear(self, columns: bool = False) -> Any:
        self._cells_drawn.clear()
        return super().clear(columns)

    def notify_style_update(self) -> None:
        self._cells_drawn.clear()  # theme or CSS changed: component styles differ
        self._styles = None
        super().notify_style_update()

    # -- the mouse hover, as DataTable shows it ---------------------------------------------------
    def on_mouse_move(self, event: events.MouseMove) -> None:
        self._mouse_over = bool(event.style.meta)

    def on_leave(self, event: events.Leave) -> None:
        self._mouse_over = False

    def on_key(self, event: events.Key) -> None:
        self._mouse_over = False  # keyboard navigation hides the hover highlight

    # -- drawing ---------------------------------------------------------------------------------
    def render_lines(self, crop: Region) -> list[Strip]:
        self._frame_style = self.rich_style  # one CSS lookup per frame, not one per line
        self._frame_pseudo = self.get_pseudo_class_state()
        try:
            return super().render_lines(crop)
        finally:
            self._frame_style = self._frame_pseudo = None

    @property
    def _pseudo(self) -> Any:
        """The pseudo classes (focus, hover, ...) the component styles depend on."""
        return self._frame_pseudo if self._frame_pseudo is not None else self.get_pseudo_class_state()

    def _style(self, name: str) -> Style:
        if self._styles is None:
            self._styles = {}
        key = (name, self._pseudo)
        style = self._styles.get(key)  # type: ignore[call-overload]
        if style is None:
            style = self._styles[key] = self.get_component_rich_style(name, partial=False) if name.endswith(
                ("cursor", "hover")) else self.get_component_styles(name).rich_style
        return style

    def render_line(self, y: int) -> Strip:
        header = self.header_height if self.show_header else 0
        if y < header or self.fixed_rows or self.cursor_type != "row":
            return super().render_line(y)
        width = self.size.width
        scroll_x, scroll_y = self.scroll_offset
        index = y - header + scroll_y
        base = self._frame_style if self._frame_style is not None else self.rich_style
        if not 0 <= index < self.row_count:
            return super().render_line(y)
        try:
            row_key = self.coordinate_to_cell_key(Coordinate(index, 0)).row_key
        except Exception:
            return super().render_line(y)
        row = self.rows.get(row_key)
        if row is None or row.height != 1 or (row.label is not None and self.show_row_labels):
            return super().render_line(y)
        columns = self.ordered_columns
        values = self.get_row(row_key)
        cursor = self.show_cursor and self.cursor_coordinate.row == index
        hover = self.show_cursor and self._mouse_over and self.hover_coordinate.row == index
        if self.zebra_stripes:
            row_style = self._style("datatable--odd-row" if index % 2 else "datatable--even-row")
        else:
            row_style = base
        drawn = self._cells_drawn.get(row_key)
        if drawn is None:
            drawn = self._cells_drawn[row_key] = {}
        fixed_n = self.fixed_columns
        fixed: list[Segment] = []
        scrollable: list[Segment] = []
        widths = [column.get_render_width(self) for column in columns]
        fixed_width = sum(widths[:fixed_n])
        table_width = sum(widths[fixed_n:])
        start, end = scroll_x + fixed_width, scroll_x + width  # the part of the scrollable line shown
        x = 0
        for column_index, column in enumerate(columns):
            cell_width = widths[column_index]
            value = values[column_index] if column_index < len(values) else None
            is_fixed = column_index < fixed_n
            if is_fixed:
                fixed += self._cell(drawn, (column.key, 1), value, self._style("datatable--fixed") + _FIXED_META,
                                    cell_width, True, cursor, hover, index, column_index)
            if x >= end:
                break  # this cell and everything after it (the fill too) lie right of the screen
            if x + cell_width > start:  # on screen, at least in part
                cell = self._cell(drawn, column.key, value, row_style, cell_width, is_fixed, cursor, hover,
                                  index, column_index)
                if x < start or x + cell_width > end:
                    cell = list(Strip(cell, cell_width).crop(max(0, start - x), min(cell_width, end - x)))
                scrollable += cell
            x += cell_width
        else:
            component = Style()
            if hover:
                component += self._style("datatable--hover")
            if cursor:
                component += self._style("datatable--cursor")
            extend = row_style + component + Style.from_meta({"row": index, "column": 0, "out_of_bounds": True})
            fill = max(0, width - table_width)
            # the fill after the last column, from x, as much of it as the screen shows
            shown = min(x + fill, end) - max(x, start)
            if shown > 0:
                scrollable.append(Segment(" " * shown, extend))
        line = fixed + scrollable
        return Strip(line).adjust_cell_length(width, base).simplify()

    def _cell(self, drawn: dict, key: Any, value: Any, row_style: Style, width: int, is_fixed: bool,
              cursor: bool, hover: bool, row_index: int, column_index: int) -> list[Segment]:
        """One cell's segments: from the cache when its value, styles and width are the same."""
        state = (row_style, width, is_fixed, cursor, hover, self.cell_padding, self._pseudo,
                 self.cursor_foreground_priority, self.cursor_background_priority)
        hit = drawn.get(key)
        if hit is not None and hit[0] is value and hit[1] == state:
            if hit[3] == (row_index, column_index):
                return hit[4]  # the same cell at the same place: the very segments of the last frame
            segments = hit[2]
        else:
            component = Style()
            if hover:
                component += self._style("datatable--hover")
            if cursor:
                component += self._style("datatable--cursor")
                if is_fixed:
                    component += self._style("datatable--fixed-cursor")
            post = Style.null()
            if self.cursor_foreground_priority == "css":
                post += Style.from_color(color=component.color)
            if self.cursor_background_priority == "css":
                post += Style.from_color(bgcolor=component.bgcolor)
            segments = fast_cell_segments(self.app.console, value, width, self.cell_padding,
                                          row_style + component, post)
            if segments is None:
                options = self.app.console_options.update_dimensions(width, 1).update(no_wrap=True)
                lines = self.app.console.render_lines(
                    Styled(Padding(cell_renderable(value), (0, self.cell_padding)), pre_style=row_style + component,
                           post_style=post), options)
                segments = lines[0] if lines else [Segment(" " * width, row_style)]
        meta = self._meta.get((row_index, column_index))
        if meta is None:
            meta = self._meta[(row_index, column_index)] = Style.from_meta({"row": row_index, "column": column_index})
        placed = [Segment(text, style + meta if style else meta, control) for text, style, control in segments]
        drawn[key] = (value, state, segments, (row_index, column_index), placed)
        return placed
