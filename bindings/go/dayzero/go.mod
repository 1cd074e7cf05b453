module dayzero

go 1.19
