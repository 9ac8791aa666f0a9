from sidindex_cli.app import main

main()
