module github.com/walrelay/walrelay/deploy/image

go 1.26.8

require (
	github.com/google/go-containerregistry v0.22.1 // indirect
	golang.org/x/crypto/x509roots/fallback v0.0.0-20261030153154-30a33513ff6d // indirect
)
