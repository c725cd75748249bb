"""``LiveTable``: a ``DataTable`` whose cells are re-rendered only when their content changed.

Textual's ``DataTable`` keys every render cache on a table-wide update counter, so one
``update_cell`` (or ``add_row``/``remove_row``) re-renders every visible cell through Rich on
the next frame: at 4 Hz with 64 instances that was most of attach's CPU. Here each cell's
rendered line is cached by the identity of the cell's value (the app replaces a value only
when its text changed) and the styles around it, without the ``row``/``column`` mouse meta,
which is added afterwards: rows that only moved (sort, the decision log dropping its oldest
rows) are not re-rendered either. Single-line text that fits its column is rendered straight
to segments; anything else goes through Rich exactly as ``DataTable`` does.
"""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.padding import Padding
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.renderables.styled import Styled
from textual.widgets import DataTable
from textual.widgets._data_table import CellDoesNotExist, ColumnKey, RowKey, default_cell_formatter

_EMPTY = Text(no_wrap=True, end="")
_LEFT = (None, "default", "left")


class LiveTable(DataTable):
    """A ``DataTable`` with a content-keyed cell cache (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # set before DataTable.__init__, whose reactive watchers already clear caches
        # row key -> column key -> (value, styles and width it was rendered with, lines without meta)
        self._content_cache: dict[Any, dict[Any, tuple[Any, tuple, list[list[Segment]]]]] = {}
        self._meta_styles: dict[tuple[int, int], Style] = {}
        self._row_styles: dict[tuple, Style] = {}  # header, fixed, even, odd; per focus state
        super().__init__(*args, **kwargs)

    def _clear_caches(self) -> None:
        super()._clear_caches()
        self._content_cache.clear()
        self._row_styles.clear()

    def notify_style_update(self) -> None:
        self._content_cache.clear()  # theme or CSS changed: component styles differ
        self._row_styles.clear()
        super().notify_style_update()

    def set_cells(self, row_key: Any, values: dict[str, Any]) -> None:
        """``update_cell`` for several cells of one row, with one refresh instead of one each."""
        if not values:
            return
        row = self._data[RowKey(row_key) if isinstance(row_key, str) else row_key]
        for column_key, value in values.items():
            ck = ColumnKey(column_key)
            if ck not in self._column_locations:
                raise CellDoesNotExist(f"No cell exists for row_key={row_key!r}, column_key={column_key!r}.")
            row[ck] = value
        self._update_count += 1
        self.refresh()

    def _get_row_style(self, row_index: int, base_style: Style) -> Style:
        # DataTable recomputes the component's rich_style (a CSS lookup) for every line drawn.
        if row_index >= self.fixed_rows and not self.zebra_stripes:
            return base_style
        kind = (-1 if row_index == -1 else -2 if row_index < self.fixed_rows else row_index % 2,
                self._pseudo_class_state)
        style = self._row_styles.get(kind)
        if style is None:
            style = self._row_styles[kind] = super()._get_row_style(row_index, base_style)
        return style

    def remove_row(self, row_key: Any) -> None:
        super().remove_row(row_key)
        self._content_cache.pop(row_key, None)  # RowKey hashes and compares like its str

    def clear(self, columns: bool = False) -> Any:
        self._content_cache.clear()
        return super().clear(columns)

    def _render_cell(self, row_index: int, column_index: int, base_style: Style, width: int,
                     cursor: bool = False, hover: bool = False) -> list[list[Segment]]:
        if column_index < 0:  # row labels: not used by kvtop, keep Textual's path
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        header = row_index == -1
        column_key = self._column_locations.get_key(column_index)
        if header:
            row_key: Any = self._header_row_key
            height = self.header_height
            value: Any = self.ordered_columns[column_index].label
        else:
            row_key = self._row_locations.get_key(row_index)
            row = self.rows.get(row_key) if row_key is not None else None
            if row is None or row.height != 1:
                return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
            height = 1
            value = self._data[row_key].get(column_key)
        fixed = not header and (row_index < self.fixed_rows or column_index < self.fixed_columns)
        state = (base_style, width, height, fixed, cursor, hover, self.show_cursor, self._show_hover_cursor,
                 self._pseudo_class_state, self.cell_padding)
        row_cache = self._content_cache.get(row_key)
        if row_cache is None:
            row_cache = self._content_cache[row_key] = {}
        hit = row_cache.get(column_key)
        if hit is not None and hit[0] is value and hit[1] == state:
            lines = hit[2]
        else:
            component_style, post_style = self._get_styles_to_render_cell(
                header, False, fixed, hover, cursor, self.show_cursor, self._show_hover_cursor,
                self.cursor_foreground_priority == "css", self.cursor_background_priority == "css")
            if header:
                renderable: Any = value
            else:
                renderable = _EMPTY if value is None else default_cell_formatter(value, wrap=False, height=1) or _EMPTY
            lines = self._render_plain(renderable, base_style + component_style, post_style, width, height)
            row_cache[column_key] = (value, state, lines)
        meta = self._meta_styles.get((row_index, column_index))
        if meta is None:
            meta = self._meta_styles[(row_index, column_index)] = Style.from_meta(
                {"row": row_index, "column": column_index})
        return [[Segment(text, style + meta if style else meta) for text, style, _ in line] for line in lines]

    def _render_plain(self, renderable: Any, pre_style: Style, post_style: Style, width: int,
                      height: int) -> list[list[Segment]]:
        """The cell's lines as ``DataTable`` renders them, minus the mouse meta."""
        pad = self.cell_padding
        inner = width - 2 * pad
        if (height == 1 and isinstance(renderable, Text) and renderable.justify in _LEFT and inner >= 0
                and "\n" not in renderable.plain and "\t" not in renderable.plain and cell_len(renderable.plain) <= inner):
            # Padding(Text) inside Styled, without Rich's line splitting and cropping.
            edge = pre_style + post_style if post_style else pre_style
            line = [Segment(" " * pad, edge)] if pad else []
            console = self.app.console
            if renderable.spans:
                segments = list(renderable.render(console, ""))  # combines the base style with spans
            else:  # Text.render leaves a span-less Text's own style to __rich_console__
                segments = [Segment(renderable.plain, console.get_style(renderable.style, default=Style.null()))]
            for text, style, _ in segments:
                if text:
                    s = pre_style + style if style else pre_style
                    line.append(Segment(text, s + post_style if post_style else s))
            fill = inner - cell_len(renderable.plain)
            if fill:
                line.append(Segment(" " * fill, edge))
            if pad:
                line.append(Segment(" " * pad, edge))
            return [line]
        options = self.app.console_options.update_dimensions(width, height)
        if height == 1:
            options = options.update(no_wrap=True)
        return self.app.console.render_lines(
            Styled(Padding(renderable, (0, pad)), pre_style=pre_style, post_style=post_style), options)
