"""The `sidindex` command line: the top layer, above the `sidindex` library and the `runtime`.

    app        the typer app, the groups below added to it, errors -> one line and an exit code
    build      sample, sid train, sid assign, build
    snapshot   inspect, validate
    explain    explain
    serve      retrieve, simulate
    options    options shared by commands, the progress bar
    render     summaries as tables or JSON, the report tables
    plot       figures for --plot (matplotlib, an optional extra)

Nothing in `sidindex`, `runtime` or `pipelines` imports this package.
"""
