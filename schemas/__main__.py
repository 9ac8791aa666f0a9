from schemas.contracts import render_markdown

print(render_markdown(), end="")
