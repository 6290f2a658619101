from mtcfs.cli import main

main()
