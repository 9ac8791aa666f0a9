from sidindex_cli.launch import main

main()
