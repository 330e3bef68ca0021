from ectransport.cli.main import main

main()
